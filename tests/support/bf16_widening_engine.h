// tests/support/bf16_widening_engine.h: a GEMM engine that takes bf16 A and B
// by widening them to f32 and handing the product to an f32 engine. Tests
// only: with it (and the emulated AVX-512 set, kernels_for_testing.cpp) the
// cpu backend's bf16-G paths (packed scores, grad_x by tile, the bf16 copies
// of G, gemm_tn_bf16) run on a CPU where no engine has bf16. Its products
// are those of an engine with bf16 dot products up to the order of the f32
// sums: bf16 x bf16 is exact in f32 (barring under- and overflow), but
// subnormals are kept, where vdpbf16ps flushes them.
#pragma once

#include "cpu/gemm/gemm.h"

namespace flce_test {

class Bf16WideningEngine final : public flce::cpu::GemmEngine {
 public:
  explicit Bf16WideningEngine(const flce::cpu::GemmEngine* f32) : f32_(f32) {}
  const char* name() const override { return "bf16-widened"; }
  std::string describe() const override;
  bool supports(flce::Dtype ab_dtype) const override {
    return ab_dtype == flce::Dtype::f32 || ab_dtype == flce::Dtype::bf16;
  }
  void run(const flce::cpu::GemmArgs& g) const override;
  std::shared_ptr<void> hold_for_calls() const override { return f32_->hold_for_calls(); }

 private:
  const flce::cpu::GemmEngine* f32_;
};

}  // namespace flce_test
