// The float64 oracle: the README's semantics as plain loops.
#pragma once

#include "flce/backend.h"

namespace flce {

const Backend& reference_backend();

}  // namespace flce
