// A small problem on host arrays, for tests of what the API does around the
// numbers (backend choice, workspace sizes, declines) rather than of them.
#pragma once

#include <cstdint>
#include <vector>

#include "flce/flce.h"

namespace flce_test {

// f32 x [n, h] and W [v, h] of zeros, labels 0, 1, ... (mod v), mean
// reduction; loss and lse as outputs, and grad_x and grad_w with `grads`.
struct ZeroStep {
  std::vector<float> x, w, lse, gx, gw;
  std::vector<int64_t> y;
  float loss = 0;
  flce::Problem p;
  ZeroStep(int64_t n, int64_t h, int64_t v, bool grads)
      : x(n * h), w(v * h), lse(n), gx(n * h), gw(v * h), y(n) {
    for (int64_t i = 0; i < n; ++i) y[i] = i % v;
    p.x = flce::matrix_view(x.data(), flce::Dtype::f32, n, h);
    p.w = flce::matrix_view(w.data(), flce::Dtype::f32, v, h);
    p.labels = flce::vector_view(y.data(), flce::Dtype::i64, n);
    p.loss = flce::scalar_view(&loss, flce::Dtype::f32);
    p.lse = flce::vector_view(lse.data(), flce::Dtype::f32, n);
    if (!grads) return;
    p.grad_x = flce::matrix_view(gx.data(), flce::Dtype::f32, n, h);
    p.grad_w = flce::matrix_view(gw.data(), flce::Dtype::f32, v, h);
  }
};

// A training step's shapes and dtypes and nothing else, for tests of a
// backend's plan (make_plan reads no tensor data): x [n, h] and W [v, h]
// as `storage`, int64 labels, grad_x and grad_W as `grads`. Every view
// points at one zero, aligned as cudaMalloc's memory is, since the cuda
// plan's fused kernels take only 16-byte aligned rows.
inline flce::Problem step_shapes(int64_t n, int64_t h, int64_t v, flce::Dtype storage,
                                 flce::Dtype grads) {
  alignas(256) static const float none[1] = {0};
  flce::Problem p;
  p.x = flce::matrix_view(&none, storage, n, h);
  p.w = flce::matrix_view(&none, storage, v, h);
  p.labels = flce::vector_view(&none, flce::Dtype::i64, n);
  p.grad_x = flce::matrix_view(&none, grads, n, h);
  p.grad_w = flce::matrix_view(&none, grads, v, h);
  return p;
}

}  // namespace flce_test
