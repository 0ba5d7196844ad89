// The `reference` backend: float64 everywhere, each formula of the README's
// "Semantics" beside the loop that computes it.
//
// Rows are processed in blocks of kRowBlock. For a block it materializes the
// block's scores s[kRowBlock, V] (never [N, V]), reduces each row to its
// statistics, turns the scores into G = d objective / d(x_i . W_j + b_j) in
// place, then accumulates grad_x, grad_W and grad_bias. Every parallel loop
// gives each output element to one thread and sums in a fixed order, so the
// bits do not depend on the thread count.
#include "reference/reference.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common/loss_terms.h"
#include "common/parallel.h"
#include "common/tensor_access.h"
#include "validate.h"

namespace flce {
namespace {

constexpr int64_t kRowBlock = 8;

// Scratch, carved from the workspace (sizes in doubles).
struct Scratch {
  double* scores;      // [kRowBlock, V]: s, then G in place
  double* slopes;      // [kRowBlock, V]: ds/dz under a softcap, for gradients
  double* x_rows;      // [kRowBlock, H]
  double* w_row;       // [threads, H]: one converted row of W per thread
  double* gx_row;      // [threads, H]: one row of grad_x per thread
  double* class_w;     // [V]
  double* row_loss;    // [N]
  double* grad_w_acc;  // [V, H] when grad_w is wanted
  double* grad_b_acc;  // [V]    when grad_bias is wanted
};

struct Layout {
  int64_t scores, slopes, x_rows, w_row, gx_row, class_w, row_loss, grad_w_acc, grad_b_acc;
  int64_t total() const {
    return scores + slopes + x_rows + w_row + gx_row + class_w + row_loss + grad_w_acc +
           grad_b_acc;
  }
};

// The threads asked for, at most as many as a loop has iterations (classes,
// or a block's rows): each thread gets scratch, and --threads 4096 on a
// problem of 12 classes asked for 2 GB of it.
int thread_count(const RunConfig& config, const Dims& d) {
  const int asked = config.threads > 0 ? config.threads : omp_get_max_threads();
  return int(std::min<int64_t>(asked, std::max(d.v, kRowBlock)));
}

Layout layout_of(const Problem& p, Pass pass, const RunConfig& config) {
  const Dims d = dims_of(p);
  const bool grads = pass != Pass::forward;
  return {kRowBlock * d.v,
          grads && p.options.softcap > 0 ? kRowBlock * d.v : 0,
          kRowBlock * d.h,
          int64_t(thread_count(config, d)) * d.h,
          grads && p.grad_x.present() ? int64_t(thread_count(config, d)) * d.h : 0,
          d.v,
          d.n,
          grads && p.grad_w.present() ? d.v * d.h : 0,
          grads && p.grad_bias.present() ? d.v : 0};
}

// A caller's scratch may start anywhere: the first double-aligned byte
// (workspace_bytes leaves room for it).
Scratch carve(const Layout& l, void* workspace) {
  const auto base = (reinterpret_cast<uintptr_t>(workspace) + alignof(double) - 1) /
                    alignof(double) * alignof(double);
  double* at = reinterpret_cast<double*>(base);
  auto take = [&](int64_t n) { double* p = at; at += n; return n ? p : nullptr; };
  Scratch s;
  s.scores = take(l.scores);
  s.slopes = take(l.slopes);
  s.x_rows = take(l.x_rows);
  s.w_row = take(l.w_row);
  s.gx_row = take(l.gx_row);
  s.class_w = take(l.class_w);
  s.row_loss = take(l.row_loss);
  s.grad_w_acc = take(l.grad_w_acc);
  s.grad_b_acc = take(l.grad_b_acc);
  return s;
}

// What every row needs to know about the whole problem.
struct Context {
  const Problem& p;
  Pass pass;
  Dims d;
  Tensor w;  // W as [V, H] whatever its layout
  double a, k, e, l;
  int threads;
  const double* class_w;  // c_j (ones when no class weights are given)
  double class_sum;  // C = sum_j c_j
  double denom;      // D = sum over non-ignored i of t_i * c_{y_i}
};

double token_weight(const Context& c, int64_t i) {
  return c.p.token_weights.present() ? load(c.p.token_weights, i) : 1.0;
}
bool ignored(const Context& c, int64_t y) { return y == c.p.options.ignore_index; }

// s_ij = k * tanh(z_ij / k) if k > 0 else z_ij.
double softcap(const Context& c, double z) { return c.k > 0 ? c.k * std::tanh(z / c.k) : z; }

// ds/dz = 1 - tanh(z/k)^2, formed as 1 / cosh(z/k)^2: from s, 1 - (s/k)^2
// cancels near saturation (relative error u / (1 - s/k), 6e-4 at z/k = 15).
double softcap_slope(const Context& c, double z) {
  const double cosh = std::cosh(z / c.k);  // its square is inf past |z/k| ~ 355: slope 0
  return 1 / (cosh * cosh);
}

// scores[r, j] = s for rows i0 .. i0+rows of the block, and slopes[r, j] =
// ds/dz where the slopes are wanted.
void set_score(const Context& c, const Scratch& s, int64_t at, double z) {
  s.scores[at] = softcap(c, z);
  if (s.slopes) s.slopes[at] = softcap_slope(c, z);
}

void compute_scores(const Context& c, int64_t i0, int64_t rows, const Scratch& s) {
  const int64_t V = c.d.v, H = c.d.h;
  if (c.d.logits_entry) {  // z_ij = a * logits_ij
    parallel_for(c.threads, 0, rows, [&](int64_t r) {
      for (int64_t j = 0; j < V; ++j)
        set_score(c, s, r * V + j, c.a * load(c.p.logits, i0 + r, j));
    });
    return;
  }
  for (int64_t r = 0; r < rows; ++r) load_row(c.p.x, i0 + r, s.x_rows + r * H);
  parallel_for(c.threads, 0, V, [&](int64_t j) {
    double* w_j = s.w_row + int64_t(omp_get_thread_num()) * H;
    load_row(c.w, j, w_j);
    const double b_j = c.p.bias.present() ? load(c.p.bias, j) : 0.0;
    for (int64_t r = 0; r < rows; ++r) {
      const double* x_i = s.x_rows + r * H;
      double dot = 0;  // x_i . W_j
      for (int64_t h = 0; h < H; ++h) dot += x_i[h] * w_j[h];
      set_score(c, s, r * V + j, c.a * (dot + b_j));  // z_ij = a (x_i . W_j + b_j)
    }
  });
}

// A row's statistics relative to `shift` (its max where finite, else 0):
// p, logp and the entropy are differences of scores, so they are formed
// from d_ij = s_ij - shift and lse_i - shift, never from two large
// numbers whose rounding cancels (with logits near 1e4, H_i = lse_i -
// sum_j p_ij s_ij lost 8 digits). lse_d is log sum_j exp(d_ij) itself, not
// lse_i - shift: lse_i's rounding at a large shift would lose it (a row
// masked whole with -1e30 has lse_i = -1e30 exactly, and lse_i - shift = 0
// gave p_ij = 1 for every j, a loss of 0 and gradients summing to V - 1).
struct RowStats {
  int64_t argmax = 0;
  double shift = 0;
  double lse = 0;        // log sum_j exp(s_ij) = shift + lse_d
  double lse_d = 0;      // log sum_j exp(s_ij - shift); see row_stats for a backward
  double sbar_d = 0;     // sum_j p_ij d_ij
  double logp_y = 0;     // d_iy - lse_d (0 when ignored)
  double sum_clogp = 0;  // sum_j c_j logp_ij

  double d(double s) const { return s - shift; }
  double p(double s) const { return std::exp(d(s) - lse_d); }  // p_ij
};

// lse with the max shift; an infinite max is not subtracted (as
// torch.logsumexp), so +Inf scores give lse = +Inf rather than NaN.
// The argmax is the lowest index of the max, or the first NaN.
void max_and_lse(const double* s, int64_t V, RowStats* st) {
  double m = s[0];
  bool nan = std::isnan(s[0]);
  for (int64_t j = 1; j < V && !nan; ++j) {
    if (std::isnan(s[j])) nan = true, st->argmax = j;
    else if (s[j] > m) m = s[j], st->argmax = j;
  }
  st->shift = std::isfinite(m) ? m : 0.0;
  double sum = 0;
  for (int64_t j = 0; j < V; ++j) sum += std::exp(st->d(s[j]));
  st->lse_d = std::log(sum);
  st->lse = st->shift + st->lse_d;
}

// Terms with p_ij = 0 (s_ij = -Inf) contribute nothing to sums of p * s.
double p_times(double p, double v) { return p == 0 ? 0.0 : p * v; }

RowStats row_stats(const Context& c, const double* s, int64_t i, int64_t y) {
  const int64_t V = c.d.v;
  RowStats st;
  max_and_lse(s, V, &st);
  if (c.pass == Pass::backward) {
    // The saved lse. Where it is this row's own (the bits forward gives),
    // lse_d stays as computed, so G's bits are those of loss_and_grad; any
    // other lse (rounded to f32, or a kernel's own) is taken as given.
    const double saved = load(c.p.lse, i);
    if (!(saved == st.lse)) st.lse_d = saved - st.shift;
    st.lse = saved;
  }
  for (int64_t j = 0; j < V; ++j) {
    st.sbar_d += p_times(st.p(s[j]), st.d(s[j]));
    if (c.e > 0) st.sum_clogp += c.class_w[j] * (st.d(s[j]) - st.lse_d);
  }
  if (!ignored(c, y)) st.logp_y = st.d(s[y]) - st.lse_d;
  return st;
}

// loss_i = t_i (ce_i + zl_i), 0 for ignored rows;
// ce_i = -(1-e) c_y logp_iy - (e/V) sum_j c_j logp_ij;  zl_i = l lse_i^2.
double row_loss(const Context& c, const RowStats& st, int64_t i, int64_t y) {
  if (ignored(c, y)) return 0.0;
  const double ce = -(1 - c.e) * c.class_w[y] * st.logp_y - (c.e / c.d.v) * st.sum_clogp;
  return token_weight(c, i) * (ce + c.l * st.lse * st.lse);
}

void write_row_outputs(const Context& c, const RowStats& st, int64_t i, double loss_i) {
  const Problem& p = c.p;
  store(p.lse, i, st.lse);
  if (p.logprob.present()) store(p.logprob, i, st.logp_y);
  if (p.argmax.present()) store(p.argmax, i, double(st.argmax));
  // H_i = lse_i - sum_j p_ij s_ij = (lse_i - shift) - sum_j p_ij d_ij
  if (p.entropy.present()) store(p.entropy, i, st.lse_d - st.sbar_d);
  if (p.zloss.present()) store(p.zloss, i, c.l * st.lse * st.lse);
  if (p.loss.present() && p.options.reduction == Reduction::none) store(p.loss, i, loss_i);
}

// Overwrites the row's scores s_ij with G_ij = d objective / d(x_i . W_j + b_j):
//   d loss_i/ds_ij = t_i [(1-e) c_y (p_ij - [j=y]) + (e/V)(C p_ij - c_j) + 2 l lse_i p_ij]
//   d lse_i/ds_ij  = p_ij
//   d H_i/ds_ij    = -p_ij (s_ij - sbar_i)
//   ds/dz = 1 - (s/k)^2 (softcap; `slopes`, formed from z),  dz/d(x.W + b) = a.
void scores_to_grad(const Context& c, double* s, const double* slopes, const RowStats& st,
                    int64_t i, int64_t y) {
  const Problem& p = c.p;
  const double g_loss = ignored(c, y) ? 0.0 : loss_cotangent(c.p, c.denom, i) * token_weight(c, i);
  const double g_lse = p.grad_lse.present() ? load(p.grad_lse, i) : 0.0;
  const double g_ent = p.grad_entropy.present() ? load(p.grad_entropy, i) : 0.0;
  const double c_y = ignored(c, y) ? 0.0 : c.class_w[y];
  for (int64_t j = 0; j < c.d.v; ++j) {
    const double p_ij = st.p(s[j]);
    double ds = 0;
    if (g_loss != 0) {
      ds += g_loss * ((1 - c.e) * c_y * (p_ij - (j == y ? 1.0 : 0.0)) +
                      (c.e / c.d.v) * (c.class_sum * p_ij - c.class_w[j]) +
                      2 * c.l * st.lse * p_ij);
    }
    ds += g_lse * p_ij;
    ds -= g_ent * p_times(p_ij, st.d(s[j]) - st.sbar_d);  // s_ij - sbar_i
    const double dsdz = slopes ? slopes[j] : 1.0;
    s[j] = c.a * dsdz * ds;
  }
}

// grad_x_i = sum_j G_ij W_j, one row per thread, j in order.
void accumulate_grad_x(const Context& c, int64_t i0, int64_t rows, const Scratch& s) {
  const int64_t V = c.d.v, H = c.d.h;
  parallel_for(c.threads, 0, rows, [&](int64_t r) {
    double* w_j = s.w_row + int64_t(omp_get_thread_num()) * H;
    double* gx = s.gx_row + int64_t(omp_get_thread_num()) * H;
    std::fill_n(gx, H, 0.0);
    for (int64_t j = 0; j < V; ++j) {
      const double g = s.scores[r * V + j];
      load_row(c.w, j, w_j);
      for (int64_t h = 0; h < H; ++h) gx[h] += g * w_j[h];
    }
    for (int64_t h = 0; h < H; ++h) store(c.p.grad_x, i0 + r, h, gx[h]);
  });
}

// grad_W_j += sum_r G_rj x_r and grad_b_j += sum_r G_rj, one j per thread,
// rows in order (blocks arrive in row order too).
void accumulate_grad_w(const Context& c, int64_t rows, const Scratch& s) {
  const int64_t V = c.d.v, H = c.d.h;
  parallel_for(c.threads, 0, V, [&](int64_t j) {
    for (int64_t r = 0; r < rows; ++r) {
      const double g = s.scores[r * V + j];
      if (s.grad_b_acc) s.grad_b_acc[j] += g;
      if (!s.grad_w_acc) continue;
      const double* x_i = s.x_rows + r * H;
      double* gw = s.grad_w_acc + j * H;
      for (int64_t h = 0; h < H; ++h) gw[h] += g * x_i[h];
    }
  });
}

void process_block(const Context& c, int64_t i0, int64_t rows, const Scratch& s) {
  const Problem& p = c.p;
  const int64_t V = c.d.v;
  compute_scores(c, i0, rows, s);
  parallel_for(c.threads, 0, rows, [&](int64_t r) {
    const int64_t i = i0 + r, y = load_int(p.labels, i);
    double* s_i = s.scores + r * V;
    const RowStats st = row_stats(c, s_i, i, y);
    if (c.pass != Pass::backward) {
      s.row_loss[i] = row_loss(c, st, i, y);
      write_row_outputs(c, st, i, s.row_loss[i]);
    }
    if (c.pass != Pass::forward)
      scores_to_grad(c, s_i, s.slopes ? s.slopes + r * V : nullptr, st, i, y);
  });
  if (c.pass == Pass::forward) return;
  if (p.grad_logits.present()) {  // rows of the block were read in full: safe in place
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < V; ++j) store(p.grad_logits, i0 + r, j, s.scores[r * V + j]);
  }
  if (p.grad_x.present()) accumulate_grad_x(c, i0, rows, s);
  if (s.grad_w_acc || s.grad_b_acc) accumulate_grad_w(c, rows, s);
}

Context make_context(const Problem& p, Pass pass, const RunConfig& config, const Scratch& s) {
  const Options& o = p.options;
  Context c{p,         pass,      dims_of(p), w_as_vh(p.w, p.w_layout), o.logit_scale, o.softcap,
            o.label_smoothing, o.z_loss, thread_count(config, dims_of(p)), s.class_w, 0.0,
            0.0};
  for (int64_t j = 0; j < c.d.v; ++j) {
    s.class_w[j] = p.class_weights.present() ? load(p.class_weights, j) : 1.0;
    c.class_sum += s.class_w[j];
  }
  c.denom = mean_denominator(p, c.d.n);
  return c;
}

void write_final(const Context& c, const Scratch& s) {
  const Problem& p = c.p;
  if (c.pass != Pass::backward && p.options.reduction != Reduction::none) {
    store(p.loss, 0, reduce_loss(p, s.row_loss, c.d.n, c.denom));
  }
  const Tensor grad_w = w_as_vh(p.grad_w, p.w_layout);
  if (s.grad_w_acc)
    for (int64_t j = 0; j < c.d.v; ++j)
      for (int64_t h = 0; h < c.d.h; ++h) store(grad_w, j, h, s.grad_w_acc[j * c.d.h + h]);
  if (s.grad_b_acc)
    for (int64_t j = 0; j < c.d.v; ++j) store(p.grad_bias, j, s.grad_b_acc[j]);
}

class ReferenceBackend final : public Backend {
 public:
  const char* name() const override { return "reference"; }
  std::string describe() const override {
    return "float64 oracle: plain loops, exact semantics, any host dtype";
  }
  Support supports(const Problem& p, Pass, const RunConfig& config) const override {
    const Tensor& first = p.logits.present() ? p.logits : p.x;
    if (first.device != Device::cpu)
      return Support::decline("the reference backend reads host memory; the tensors are on a "
                              "CUDA device (copy them to the host, or use a CUDA backend)");
    if (!config.gemm.empty())  // asked for, so not to be ignored
      return Support::decline("gemm = '" + config.gemm + "': the reference backend has no GEMM "
                              "engine (its products are float64 loops)");
    return Support::accept();
  }
  size_t workspace_bytes(const Problem& p, Pass pass, const RunConfig& config) const override {
    return size_t(layout_of(p, pass, config).total()) * sizeof(double) + alignof(double);
  }
  std::string run(const Problem& p, Pass pass, const RunConfig& config, void* workspace,
                  RunStats*) const override {
    const Layout layout = layout_of(p, pass, config);
    const Scratch s = carve(layout, workspace);
    std::fill_n(s.grad_w_acc, layout.grad_w_acc, 0.0);
    std::fill_n(s.grad_b_acc, layout.grad_b_acc, 0.0);
    const Context c = make_context(p, pass, config, s);
    for (int64_t i0 = 0; i0 < c.d.n; i0 += kRowBlock)
      process_block(c, i0, std::min(kRowBlock, c.d.n - i0), s);
    write_final(c, s);
    return "";
  }
};

}  // namespace

const Backend& reference_backend() {
  static const ReferenceBackend backend;
  return backend;
}

}  // namespace flce
