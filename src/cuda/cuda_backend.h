#pragma once

#include "flce/backend.h"

namespace flce {

// The `cuda` backend (src/cuda/). In a build without the CUDA toolkit it is
// still listed, and declines every problem saying so.
const Backend& cuda_backend();

}  // namespace flce
