// The oneDNN engine: dnnl::matmul with f32 or bf16 A and B and an f32 C.
//
// Layouts. Every operand is described by a plain 2-D memory descriptor with
// explicit strides, so a transpose or a sub-matrix costs no copy: row-major
// [rows, cols] with leading dimension ld has strides {ld, 1}; its transpose
// has strides {1, ld}. beta != 0 is a sum post-op with scale beta (oneDNN then
// reads C before adding); beta == 0 has no post-op, so C is write-only.
//
// Primitives. Creating a matmul primitive descriptor and primitive takes far
// longer than a tile's product, so they are made once per (sizes, leading
// dimensions, transposes, dtype, beta) and kept in a process-wide cache under
// a mutex. Each thread also keeps its own small map from that key to the
// dnnl::memory objects and argument map it executes with, and only swaps
// pointers in per call, so the steady state takes no lock and builds nothing.
//
// Threads. Debian's libdnnl is built with OpenMP. Inside an active OpenMP
// parallel region oneDNN runs a primitive on the calling thread; outside one
// it would use omp_get_max_threads() threads. So every creation and execution
// here runs with the calling thread's OpenMP thread count (nthreads-var, an
// ICV private to the thread's task) set to 1 and then restored: the
// primitives are always built for one thread, run on the caller, and give the
// same bits wherever they run. The scratchpad is in user mode, from a
// per-thread buffer: in library mode oneDNN shares one scratchpad per
// primitive, and then "the same primitive cannot be run concurrently from two
// different threads" (dnnl_types.h).
#include <omp.h>

#include <oneapi/dnnl/dnnl.hpp>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "cpu/gemm/gemm.h"

namespace flce::cpu {
namespace {

using dnnl::matmul;
using dnnl::memory;
using Dims = memory::dims;

// Sets the calling thread's OpenMP thread count to 1 for its lifetime.
class OneOmpThread {
 public:
  OneOmpThread() : saved_(omp_get_max_threads()) {
    if (saved_ != 1) omp_set_num_threads(1);
  }
  ~OneOmpThread() {
    if (saved_ != 1) omp_set_num_threads(saved_);
  }
  OneOmpThread(const OneOmpThread&) = delete;
  OneOmpThread& operator=(const OneOmpThread&) = delete;

 private:
  int saved_;
};

// The engine is created once and never destroyed: memory objects in other
// threads' thread_local caches refer to it, and those may outlive statics.
const dnnl::engine& cpu_engine() {
  static const dnnl::engine* engine = new dnnl::engine(dnnl::engine::kind::cpu, 0);
  return *engine;
}

struct Key {
  int64_t m, n, k, lda, ldb, ldc;
  uint32_t beta_bits;
  uint8_t dtype, trans_a, trans_b, b_packed;

  bool operator==(const Key& o) const {
    return m == o.m && n == o.n && k == o.k && lda == o.lda && ldb == o.ldb &&
           ldc == o.ldc && beta_bits == o.beta_bits && dtype == o.dtype &&
           trans_a == o.trans_a && trans_b == o.trans_b && b_packed == o.b_packed;
  }
};

struct KeyHash {
  size_t operator()(const Key& key) const {
    uint64_t h = 1469598103934665603ull;
    auto mix = [&h](uint64_t v) {
      h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    };
    mix(uint64_t(key.m));
    mix(uint64_t(key.n));
    mix(uint64_t(key.k));
    mix(uint64_t(key.lda));
    mix(uint64_t(key.ldb));
    mix(uint64_t(key.ldc));
    mix(key.beta_bits);
    mix(uint64_t(key.dtype) | uint64_t(key.trans_a) << 8 | uint64_t(key.trans_b) << 16 |
        uint64_t(key.b_packed) << 24);
    return size_t(h);
  }
};

Key make_key(const GemmArgs& g) {
  Key key;
  key.m = g.m;
  key.n = g.n;
  key.k = g.k;
  key.lda = g.lda;
  key.ldb = g.ldb;
  key.ldc = g.ldc;
  std::memcpy(&key.beta_bits, &g.beta, sizeof(float));
  key.dtype = uint8_t(g.ab_dtype);
  key.trans_a = g.trans_a;
  key.trans_b = g.trans_b;
  key.b_packed = g.b_packed;
  return key;
}

// What every thread shares for one key.
struct Plan {
  matmul primitive;
  memory::desc a_md, b_md, c_md, scratch_md;
  size_t scratch_bytes = 0;
  std::string impl;  // oneDNN's implementation name, e.g. "brg:avx512_core_bf16"
};

memory::data_type dnnl_type(Dtype dtype) {
  return dtype == Dtype::bf16 ? memory::data_type::bf16 : memory::data_type::f32;
}

// A [rows, cols] matrix stored row-major with leading dimension ld, or its
// transpose: [cols, rows] stored as [rows, cols].
memory::desc matrix_md(int64_t rows, int64_t cols, int64_t ld, bool trans,
                       memory::data_type type) {
  if (!trans) return memory::desc(Dims{rows, cols}, type, Dims{ld, 1});
  return memory::desc(Dims{rows, cols}, type, Dims{1, ld});
}

matmul::primitive_desc make_pd(const GemmArgs& g, const memory::desc& a_md, const memory::desc& b_md,
                               const memory::desc& c_md) {
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  // f32 products in f32 whatever ONEDNN_DEFAULT_FPMATH_MODE says (bf16 or
  // tf32 there would make the f32 engine a lower-precision one unasked).
  attr.set_fpmath_mode(dnnl::fpmath_mode::strict);
  if (g.beta != 0.0f) {
    dnnl::post_ops ops;
    ops.append_sum(g.beta);
    attr.set_post_ops(ops);
  }
  return matmul::primitive_desc(matmul::desc(a_md, b_md, c_md), attr, cpu_engine());
}

// B's layout when packed for calls of g's shape: the one oneDNN picks given
// the choice (format_tag::any) with beta = 0, if primitives given that
// layout back, with beta 0 and 1, run that implementation and not the
// reference one; else an empty desc. oneDNN picks by the whole call (a
// transposed A with lda != m, or m not a multiple of its blocking, got a
// layout only the reference matmul takes), so this is asked per shape. The
// caller holds a OneOmpThread.
memory::desc packed_b_md(const GemmArgs& g) {
  const memory::data_type ab = dnnl_type(g.ab_dtype);
  const memory::desc a_md = matrix_md(g.m, g.k, g.lda, g.trans_a, ab);
  const memory::desc c_md = matrix_md(g.m, g.n, g.ldc, false, memory::data_type::f32);
  const memory::desc any(Dims{g.k, g.n}, ab, memory::format_tag::any);
  GemmArgs shape = g;
  shape.beta = 0.0f;
  const matmul::primitive_desc chosen = make_pd(shape, a_md, any, c_md);
  const memory::desc packed = chosen.weights_desc();
  const std::string impl = chosen.impl_info_str();
  if (impl.rfind("ref", 0) == 0) return {};
  for (float beta : {0.0f, 1.0f}) {
    shape.beta = beta;
    if (make_pd(shape, a_md, packed, c_md).impl_info_str() != impl) return {};
  }
  return packed;
}

// packed_b_md, asked once per shape (each asks oneDNN for three primitive
// descriptors, and the backend asks for every row block).
memory::desc cached_packed_b_md(const GemmArgs& g) {
  static std::mutex mutex;
  static auto* layouts = new std::unordered_map<Key, memory::desc, KeyHash>;  // never destroyed
  GemmArgs shape = g;
  shape.beta = 0.0f, shape.b_packed = true;
  const Key key = make_key(shape);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = layouts->find(key);
  if (it == layouts->end()) {
    if (layouts->size() >= 4096) layouts->clear();
    it = layouts->emplace(key, packed_b_md(shape)).first;
  }
  return it->second;
}

// Builds the plan; the caller holds a OneOmpThread.
std::shared_ptr<const Plan> build_plan(const GemmArgs& g) {
  auto plan = std::make_shared<Plan>();
  memory::data_type ab = dnnl_type(g.ab_dtype);
  plan->a_md = matrix_md(g.m, g.k, g.lda, g.trans_a, ab);
  plan->b_md = g.b_packed ? cached_packed_b_md(g) : matrix_md(g.k, g.n, g.ldb, g.trans_b, ab);
  if (plan->b_md.is_zero())
    throw std::invalid_argument("gemm engine onednn: B packed for a shape it does not pack");
  plan->c_md = matrix_md(g.m, g.n, g.ldc, false, memory::data_type::f32);
  matmul::primitive_desc pd = make_pd(g, plan->a_md, plan->b_md, plan->c_md);
  if (g.b_packed && std::string(pd.impl_info_str()).rfind("ref", 0) == 0)
    throw std::invalid_argument("gemm engine onednn: B packed for a beta it does not pack for");
  plan->scratch_md = pd.scratchpad_desc();
  plan->scratch_bytes = plan->scratch_md.get_size();
  plan->impl = pd.impl_info_str();
  plan->primitive = matmul(pd);
  return plan;
}

class PlanCache {
 public:
  std::shared_ptr<const Plan> get(const Key& key, const GemmArgs& g) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = plans_.find(key);
    if (it != plans_.end()) return it->second;
    // A bound, in case a caller sweeps through shapes: plans in use stay
    // alive through the threads' shared_ptrs.
    if (plans_.size() >= 4096) plans_.clear();
    auto plan = build_plan(g);
    plans_.emplace(key, plan);
    return plan;
  }

 private:
  std::mutex mutex_;
  std::unordered_map<Key, std::shared_ptr<const Plan>, KeyHash> plans_;
};

PlanCache& plan_cache() {
  static PlanCache* cache = new PlanCache;  // never destroyed, like the engine
  return *cache;
}

// Per thread: the stream, a scratchpad buffer and, per key, the memory
// objects bound to the plan's descriptors.
struct ThreadState {
  struct Bound {
    std::shared_ptr<const Plan> plan;
    memory a, b, c, scratch;
    std::unordered_map<int, memory> args;
  };

  dnnl::stream stream{cpu_engine()};
  std::unordered_map<Key, Bound, KeyHash> bound;
  void* scratch = nullptr;
  size_t scratch_bytes = 0;

  ~ThreadState() { std::free(scratch); }

  void* scratch_of(size_t bytes) {
    if (bytes > scratch_bytes) {
      size_t size = (bytes + 4095) / 4096 * 4096;
      void* p = std::aligned_alloc(4096, size);
      if (p == nullptr) throw std::bad_alloc();
      std::free(scratch);
      scratch = p;
      scratch_bytes = size;
    }
    return scratch;
  }

  Bound& bind(const Key& key, const GemmArgs& g) {
    auto it = bound.find(key);
    if (it != bound.end()) return it->second;
    if (bound.size() >= 256) bound.clear();
    Bound b;
    b.plan = plan_cache().get(key, g);
    const dnnl::engine& e = cpu_engine();
    // Created without data (DNNL_MEMORY_NONE); run() sets the pointers.
    b.a = memory(b.plan->a_md, e, DNNL_MEMORY_NONE);
    b.b = memory(b.plan->b_md, e, DNNL_MEMORY_NONE);
    b.c = memory(b.plan->c_md, e, DNNL_MEMORY_NONE);
    b.args = {{DNNL_ARG_SRC, b.a}, {DNNL_ARG_WEIGHTS, b.b}, {DNNL_ARG_DST, b.c}};
    if (b.plan->scratch_bytes > 0) {
      b.scratch = memory(b.plan->scratch_md, e, DNNL_MEMORY_NONE);
      b.args.emplace(DNNL_ARG_SCRATCHPAD, b.scratch);
    }
    return bound.emplace(key, std::move(b)).first->second;
  }
};

ThreadState& thread_state() {
  thread_local ThreadState state;
  return state;
}

// oneDNN's implementation name for a bf16 logits-tile shape ("" if it
// has none), e.g. "brg:avx512_core_amx_bf16".
std::string probe_bf16_impl() {
  try {
    OneOmpThread one;
    GemmArgs g;
    g.m = 64;
    g.n = 256;
    g.k = 128;
    g.ab_dtype = Dtype::bf16;
    g.lda = 128;
    g.ldb = 128;
    g.trans_b = true;
    g.ldc = 256;
    return build_plan(g)->impl;
  } catch (const dnnl::error&) {
    return "";
  }
}

const std::string& bf16_impl() {
  static const std::string impl = probe_bf16_impl();
  return impl;
}

// Whether oneDNN has a native bf16 kernel here: not its reference one, and
// an ISA (after ONEDNN_MAX_CPU_ISA) with bf16 dot products. On plain
// AVX-512 (Skylake to Ice Lake) it emulates bf16 in gemm:jit, several times
// slower than converting to f32 (README, "GEMM engines"): there bf16 is left
// to that conversion.
bool probe_bf16() {
  const unsigned isa = unsigned(dnnl_get_effective_cpu_isa()), bf16 = dnnl_cpu_isa_avx512_core_bf16;
  return !bf16_impl().empty() && bf16_impl().rfind("ref", 0) != 0 && (isa & bf16) == bf16;
}

class OneDnnEngine final : public GemmEngine {
 public:
  const char* name() const override { return "onednn"; }

  std::string describe() const override {
    const dnnl_version_t* v = dnnl_version();
    std::string s = "onednn " + std::to_string(v->major) + "." +
                    std::to_string(v->minor) + "." + std::to_string(v->patch);
    OneOmpThread one;
    try {
      GemmArgs g;
      g.m = 64;
      g.n = 256;
      g.k = 128;
      g.lda = 128;
      g.ldb = 128;
      g.trans_b = true;
      g.ldc = 256;
      s += " (f32: " + build_plan(g)->impl;
      g.ab_dtype = Dtype::bf16;
      s += supports(Dtype::bf16) ? ", bf16: " + build_plan(g)->impl : ", no bf16";
      s += ", 1 thread per call)";
    } catch (const dnnl::error& e) {
      s += std::string(" (") + e.what() + ")";
    }
    return s;
  }

  bool supports(Dtype ab_dtype) const override {
    if (ab_dtype == Dtype::f32) return true;
    if (ab_dtype != Dtype::bf16) return false;
    static const bool bf16 = probe_bf16();
    return bf16;
  }

  // oneDNN picks AMX where the CPU and the kernel grant the tiles (and
  // ONEDNN_MAX_CPU_ISA allows it); its implementation name says so.
  bool bf16_on_matrix_unit() const override {
    return supports(Dtype::bf16) && bf16_impl().find("amx") != std::string::npos;
  }

  // Only on AMX, where B's reorder into pairs of rows is a visible share of
  // a short-k product: grad_W's bf16 tiles ([512, H] += G^T x with k = the
  // block's rows) ran 1125-1200 -> 1283-1504 GFLOP/s with x packed once
  // (a scratch program, 2 threads, k = 496 and 1024, H = 768, 2304, 4096).
  size_t packed_b_bytes(const GemmArgs& g) const override {
    if (g.ab_dtype != Dtype::bf16 || !bf16_on_matrix_unit() || g.m == 0 || g.n == 0 || g.k == 0) return 0;
    OneOmpThread one;
    try {
      return cached_packed_b_md(g).get_size();
    } catch (const dnnl::error&) {
      return 0;
    }
  }

  void pack_b(const GemmArgs& g, void* packed) const override {
    if (packed_b_bytes(g) == 0)
      throw std::invalid_argument("gemm engine onednn: does not pack B for this shape");
    OneOmpThread one;
    const memory::data_type ab = dnnl_type(g.ab_dtype);
    memory src(matrix_md(g.k, g.n, g.ldb, g.trans_b, ab), cpu_engine(), const_cast<void*>(g.b));
    memory dst(cached_packed_b_md(g), cpu_engine(), packed);
    dnnl::stream stream(cpu_engine());
    dnnl::reorder(src, dst).execute(stream, src, dst);
    stream.wait();
  }

  void run(const GemmArgs& g) const override {
    gemm_detail::check_args(g, "onednn");
    if (!supports(g.ab_dtype))
      throw std::invalid_argument(std::string("gemm engine onednn: A and B are ") +
                                  dtype_name(g.ab_dtype) +
                                  ", which oneDNN has no kernel for on this CPU");
    if (gemm_detail::run_degenerate(g)) return;
    OneOmpThread one;
    ThreadState& ts = thread_state();
    Key key = make_key(g);
    ThreadState::Bound& b = ts.bind(key, g);
    b.a.set_data_handle(const_cast<void*>(g.a));
    b.b.set_data_handle(const_cast<void*>(g.b));
    b.c.set_data_handle(g.c);
    if (b.plan->scratch_bytes > 0)
      b.scratch.set_data_handle(ts.scratch_of(b.plan->scratch_bytes));
    b.plan->primitive.execute(ts.stream, b.args);
    ts.stream.wait();
  }
};

}  // namespace

const GemmEngine* onednn_gemm_engine() {
  static const OneDnnEngine engine;
  return &engine;
}

}  // namespace flce::cpu
