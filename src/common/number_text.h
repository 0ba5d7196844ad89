// A number for an error message: the shortest "%g" text (6 to 17 digits)
// that reads back as the same double. "%g" alone keeps 6 digits, and a
// message then contradicts itself: "label_smoothing = 1: must be in [0, 1]"
// for 1.0000001.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

namespace flce {

inline std::string number_text(double v) {
  char text[32];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(text, sizeof text, "%.*g", digits, v);
    if (std::strtod(text, nullptr) == v) break;  // NaN never is: "nan" at 17 digits
  }
  return text;
}

}  // namespace flce
