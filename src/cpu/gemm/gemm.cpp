// The gemm engine registry and the default choice.
//
// DEFAULTS: f32 -> onednn, bf16 -> onednn (the only engine with native bf16).
// Preference order: onednn, openblas, eigen.
//
// Measured on the dev machine (2 cores AMD Zen 5, AVX-512 + AVX512-BF16;
// oneDNN 2.6.3, OpenBLAS 0.3.21 pthreads, Eigen 3.4.0, g++ 12 -O3) with
//   cmake --build <build> --target flce_gemm_engines
//   <build>/flce_gemm_engines --seconds 0.3 --repeats 3                    # run A
//   env -u OPENBLAS_CORETYPE <build>/flce_gemm_engines --engines onednn,openblas
//       --dtypes f32 --seconds 0.3 --repeats 3                              # run B
//   OPENBLAS_CORETYPE=SkylakeX <build>/flce_gemm_engines --engines openblas
//       --dtypes f32 --seconds 0.3 --repeats 3                             # run C
// as the backend runs them: 2 OpenMP threads, each calling the engine on its
// own tiles (W streamed tile by tile from a >= 64 MiB array). GFLOP/s of both
// threads together, each thread's flops over its own CPU time (the machine
// was shared and loaded, so wall-clock rates were 1.5-4x lower and noisy;
// each cell is the best of 3). Shapes, for rows R, vocab tile T, hidden H:
// logits m=R n=T k=H (B^T, beta 0); grad_x m=R n=H k=T (beta 1);
// grad_W m=T n=H k=R (A^T, beta 1). bf16 = bf16 A and B, f32 C.
//
//                        | run A: env OPENBLAS_CORETYPE=Haswell  | run B: unset   | run C
// kind    rows tile    H | onednn openblas  eigen  onednn  | onednn openblas| openblas
//                        |  f32   Haswell   SSE2    bf16   |  f32  Cooperlk | SkylakeX
// logits    64  256  128 |    258    156     66     548   |    295    250 |    241
// logits    64 1024  128 |    273    158     71     564   |    287    234 |    244
// logits   256  256  128 |    362    192     79     704   |    373    350 |    336
// logits   256 1024  128 |    366    190     76     699   |    395    355 |    309
// logits    64  256  768 |    292    153     69     567   |    312    271 |    239
// logits    64 1024  768 |    320    166     69     535   |    320    268 |    257
// logits   256  256  768 |    366    201     81     707   |    391    359 |    339
// logits   256 1024  768 |    386    200     80     736   |    391    368 |    346
// logits    64  256 2304 |    309    170     76     614   |    317    286 |    263
// logits    64 1024 2304 |    317    169     75     582   |    318    284 |    270
// logits   256  256 2304 |    350    181     81     770   |    404    381 |    345
// logits   256 1024 2304 |    374    195     78     762   |    405    380 |    356
// logits    64  256 4096 |    315    165     75     607   |    328    274 |    264
// logits    64 1024 4096 |    314    159     70     582   |    336    277 |    250
// logits   256  256 4096 |    369    190     72     755   |    408    361 |    369
// logits   256 1024 4096 |    380    194     79     767   |    409    370 |    367
// grad_x    64  256  128 |    325    164     66     493   |    346    281 |    266
// grad_x    64 1024  128 |    342    173     73     528   |    356    283 |    258
// grad_x   256  256  128 |    378    190     77     688   |    401    370 |    349
// grad_x   256 1024  128 |    358    183     76     714   |    400    368 |    344
// grad_x    64  256  768 |    318    171     65     455   |    342    294 |    259
// grad_x    64 1024  768 |    264    152     65     489   |    338    294 |    267
// grad_x   256  256  768 |    348    187     77     600   |    395    384 |    376
// grad_x   256 1024  768 |    313    183     76     712   |    394    384 |    371
// grad_x    64  256 2304 |    230    160     63     426   |    325    288 |    279
// grad_x    64 1024 2304 |    237    171     69     480   |    298    283 |    288
// grad_x   256  256 2304 |    328    193     79     633   |    355    368 |    373
// grad_x   256 1024 2304 |    359    194     75     653   |    374    363 |    381
// grad_x    64  256 4096 |    251    161     67     398   |    276    234 |    250
// grad_x    64 1024 4096 |    242    175     66     442   |    280    242 |    245
// grad_x   256  256 4096 |    301    194     73     594   |    340    362 |    363
// grad_x   256 1024 4096 |    339    193     76     673   |    373    354 |    348
// grad_W    64  256  128 |    197    151     71     251   |    200    339 |    349
// grad_W    64 1024  128 |    191    150     75     260   |    194    321 |    324
// grad_W   256  256  128 |    300    196     73     468   |    275    368 |    363
// grad_W   256 1024  128 |    291    175     70     440   |    320    344 |    361
// grad_W    64  256  768 |    203    183     78     278   |    202    306 |    331
// grad_W    64 1024  768 |    211    194     79     273   |    196    310 |    325
// grad_W   256  256  768 |    314    182     77     547   |    355    401 |    392
// grad_W   256 1024  768 |    328    194     73     516   |    347    382 |    414
// grad_W    64  256 2304 |    197    166     68     262   |    194    274 |    312
// grad_W    64 1024 2304 |    205    183     78     284   |    201    274 |    325
// grad_W   256  256 2304 |    326    201     81     527   |    329    377 |    400
// grad_W   256 1024 2304 |    342    199     82     522   |    339    390 |    411
// grad_W    64  256 4096 |    217    197     79     296   |    215    285 |    310
// grad_W    64 1024 4096 |    222    192     81     291   |    208    291 |    338
// grad_W   256  256 4096 |    324    205     79     541   |    314    322 |    373
// grad_W   256 1024 4096 |    312    208     81     541   |    310    387 |    402
//
// Why. f32: oneDNN beats OpenBLAS with the Haswell (AVX2) kernels that this
// environment forces through OPENBLAS_CORETYPE=Haswell on every shape
// (geometric means 1.9x logits, 1.7x grad_x, 1.4x grad_W). With OpenBLAS's
// own choice here (Cooperlake = AVX-512 kernels, env unset, run B, interleaved
// with oneDNN shape by shape), oneDNN still wins logits (1.13x) and grad_x
// (1.09x) but loses grad_W, the A^T product, by 1.3x (1.4-1.7x at R=64,
// where oneDNN's brgemm stays near 200): one engine per dtype has to be
// oneDNN, and a caller that wants the last 30% of grad_W can pick openblas
// for it when describe() shows AVX-512 kernels. OPENBLAS_CORETYPE=SkylakeX
// (run C) is the same as Cooperlake within noise (+-10%, separate runs); it only works exported
// before the process starts: setenv() in main() is too late (the library
// picks its kernels when it is loaded; checked with --setenv-coretype).
// bf16: only oneDNN takes it natively (brg:avx512_core_bf16), 1.5-2x its own
// f32 rate (geometric means 1.96x logits, 1.81x grad_x, 1.47x grad_W); the
// Debian OpenBLAS exports no sbgemm, Eigen has no bf16 kernels.
// Eigen, compiled for baseline x86-64 (SSE2) as the library must be, runs at
// 65-80; the same file built by hand with -mavx2 -mfma gives ~190-200 and -march=native
// ~255-280 (R=256, T=1024, H 768/4096): it is only the fallback.
#include "cpu/gemm/gemm.h"

#include <atomic>
#include <climits>
#include <cstring>
#include <stdexcept>
#include <string>

namespace flce::cpu {

#ifdef FLCE_HAVE_ONEDNN
const GemmEngine* onednn_gemm_engine();
#endif
#ifdef FLCE_HAVE_OPENBLAS
const GemmEngine* openblas_gemm_engine();
#endif
const GemmEngine* eigen_gemm_engine();

const std::vector<const GemmEngine*>& gemm_engines() {
  // In order of preference, from the measurements above.
  static const std::vector<const GemmEngine*> engines = [] {
    std::vector<const GemmEngine*> list;
#ifdef FLCE_HAVE_ONEDNN
    list.push_back(onednn_gemm_engine());
#endif
#ifdef FLCE_HAVE_OPENBLAS
    list.push_back(openblas_gemm_engine());
#endif
    list.push_back(eigen_gemm_engine());
    return list;
  }();
  return engines;
}

const GemmEngine* find_gemm_engine(const std::string& name) {
  for (const GemmEngine* e : gemm_engines())
    if (name == e->name()) return e;
  return nullptr;
}

namespace {
std::atomic<const GemmEngine*> bf16_engine_for_testing{nullptr};  // constant-initialized
}  // namespace

void set_bf16_gemm_engine_for_testing(const GemmEngine* engine) { bf16_engine_for_testing.store(engine); }

const GemmEngine* default_gemm_engine(Dtype ab_dtype) {
  if (ab_dtype == Dtype::bf16)
    if (const GemmEngine* e = bf16_engine_for_testing.load()) return e;
  for (const GemmEngine* e : gemm_engines())
    if (e->supports(ab_dtype)) return e;
  return nullptr;
}

void GemmEngine::pack_b(const GemmArgs&, void*) const {
  throw std::invalid_argument(std::string("gemm engine ") + name() + " does not pack B");
}

namespace gemm_detail {

namespace {
[[noreturn]] void fail(const char* engine, const std::string& what) {
  throw std::invalid_argument(std::string("gemm engine ") + engine + ": " + what);
}
}  // namespace

void check_args(const GemmArgs& g, const char* engine) {
  if (g.b_packed && g.ab_dtype != Dtype::bf16) fail(engine, "only bf16 B is packed");
  if (g.m < 0 || g.n < 0 || g.k < 0)
    fail(engine, "negative size m=" + std::to_string(g.m) + " n=" + std::to_string(g.n) +
                     " k=" + std::to_string(g.k));
  // Kept within 32 bits so every library can take them (OpenBLAS's blasint).
  if (g.m > INT_MAX || g.n > INT_MAX || g.k > INT_MAX || g.lda > INT_MAX ||
      g.ldb > INT_MAX || g.ldc > INT_MAX)
    fail(engine, "a size or leading dimension exceeds 2^31-1");
  if (g.ab_dtype != Dtype::f32 && g.ab_dtype != Dtype::bf16)
    fail(engine, "A and B must be f32 or bf16");
  if (g.m == 0 || g.n == 0) return;
  int64_t a_cols = g.trans_a ? g.m : g.k;
  int64_t b_cols = g.trans_b ? g.k : g.n;
  if (g.ldc < g.n) fail(engine, "ldc=" + std::to_string(g.ldc) + " < n=" + std::to_string(g.n));
  if (g.c == nullptr) fail(engine, "C is null");
  if (g.k == 0) return;
  if (g.lda < a_cols)
    fail(engine, "lda=" + std::to_string(g.lda) + " < " + std::to_string(a_cols) +
                     (g.trans_a ? " (m, A transposed)" : " (k)"));
  if (g.ldb < b_cols)
    fail(engine, "ldb=" + std::to_string(g.ldb) + " < " + std::to_string(b_cols) +
                     (g.trans_b ? " (k, B transposed)" : " (n)"));
  if (g.a == nullptr || g.b == nullptr) fail(engine, "A or B is null");
}

bool run_degenerate(const GemmArgs& g) {
  if (g.m == 0 || g.n == 0) return true;
  if (g.k != 0) return false;
  for (int64_t i = 0; i < g.m; ++i) {
    float* row = g.c + i * g.ldc;
    if (g.beta == 0.0f) {
      std::memset(row, 0, sizeof(float) * size_t(g.n));
    } else if (g.beta != 1.0f) {
      for (int64_t j = 0; j < g.n; ++j) row[j] *= g.beta;
    }
  }
  return true;
}

}  // namespace gemm_detail
}  // namespace flce::cpu
