// A number for an error message: the shortest "%g" text (6 to 17 digits)
// that reads back as the same value in the dtype it was stored in. "%g"
// alone keeps 6 digits, and a message then contradicts itself:
// "label_smoothing = 1: must be in [0, 1]" for 1.0000001. A value stored in
// float32 (or narrower) is read back as float32, so -1e-30 stays "-1e-30",
// not its double expansion -1.0000000031710769e-30.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#include "flce/tensor.h"

namespace flce {

inline std::string number_text(double v, Dtype stored = Dtype::f64) {
  char text[32];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(text, sizeof text, "%.*g", digits, v);
    const double back = std::strtod(text, nullptr);
    // NaN never reads back equal: "nan" at 17 digits.
    if (stored == Dtype::f64 ? back == v : float(back) == float(v)) break;
  }
  return text;
}

}  // namespace flce
