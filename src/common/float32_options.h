// The options a backend that computes in float32 can hold. A logit scale or
// a softcap outside float32's normal range turns into inf or 0 there: a
// softcap of 1e300 made every score NaN, one of 1e-300 turned the softcap
// off. The kernels also use 1/k and k log2(e): above 2^126 (about 8.5e37)
// 1/k is subnormal (z/k loses digits), and above 2.36e38 k log2(e) is inf
// (the fused CUDA kernel would form 0 inf = NaN at z = 0, found by reading
// it), so a softcap must be at most 2^126. Such a backend declines the
// others (the reference takes any finite value).
#pragma once

#include <cfloat>
#include <cstdio>
#include <string>

#include "common/number_text.h"
#include "flce/flce.h"

namespace flce {

// "" or why `backend` declines the options.
inline std::string float32_options_problem(const Options& o, const char* backend) {
  const struct {
    const char* name;
    double value, most;
    bool zero_is_off;
    const char* range;
  } scalars[] = {
      {"logit_scale", o.logit_scale, FLT_MAX, false, "float32's normal range"},
      {"softcap", o.softcap, 1 / double(FLT_MIN), true,
       "the range where it and its reciprocal are normal float32"}};
  for (const auto& s : scalars) {
    if (s.zero_is_off && s.value == 0) continue;
    if (s.value >= FLT_MIN && s.value <= s.most) continue;
    char text[320];
    std::snprintf(text, sizeof text,
                  "%s = %s is outside %s [%s, %s], in which the %s backend computes (the "
                  "reference backend takes it)",
                  s.name, number_text(s.value).c_str(), s.range, number_text(FLT_MIN).c_str(),
                  number_text(s.most).c_str(), backend);
    return text;
  }
  return "";
}

}  // namespace flce
