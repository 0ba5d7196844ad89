// A training step through the C++ API: loss, lse and gradients for a small
// LM head, without ever holding the [N, V] logits. Public headers only.
#include <flce/flce.h>

#include <cstdio>
#include <random>
#include <vector>

int main() {
  const int64_t N = 4, H = 16, V = 1000;
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> x(N * H), w(V * H);  // x [N, H], w [V, H] (lm_head.weight)
  for (float& v : x) v = normal(rng);
  for (float& v : w) v = 0.1f * normal(rng);
  std::vector<int64_t> labels = {3, 999, -100, 42};  // row 2 is ignored

  float loss = 0;
  std::vector<float> lse(N), grad_x(N * H), grad_w(V * H);
  flce::Problem p;
  p.x = flce::matrix_view(x.data(), flce::Dtype::f32, N, H);
  p.w = flce::matrix_view(w.data(), flce::Dtype::f32, V, H);
  p.labels = flce::vector_view(labels.data(), flce::Dtype::i64, N);
  p.options.label_smoothing = 0.1;
  p.options.reduction = flce::Reduction::mean;
  p.loss = flce::scalar_view(&loss, flce::Dtype::f32);
  p.lse = flce::vector_view(lse.data(), flce::Dtype::f32, N);
  p.grad_x = flce::matrix_view(grad_x.data(), flce::Dtype::f32, N, H);
  p.grad_w = flce::matrix_view(grad_w.data(), flce::Dtype::f32, V, H);

  const flce::Status status = flce::loss_and_grad(p);
  if (!status.ok()) {
    std::fprintf(stderr, "flce: %s\n", status.error.c_str());
    return 1;
  }
  std::printf("backend: %s\nloss: %.6f\nlse: %.4f %.4f %.4f %.4f\ngrad_x[0][0]: %.6g\n",
              status.backend.c_str(), loss, lse[0], lse[1], lse[2], lse[3], grad_x[0]);
  return 0;
}
