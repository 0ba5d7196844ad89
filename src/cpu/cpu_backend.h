// The `cpu` backend: vocab-tiled GEMM + SIMD online softmax (src/cpu/steps.h).
#pragma once

#include "flce/backend.h"

namespace flce {

const Backend& cpu_backend();

}  // namespace flce
