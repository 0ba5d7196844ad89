// The options a backend that computes in float32 can hold. A logit scale or
// a softcap outside float32's normal range turns into inf or 0 there: a
// softcap of 1e300 made every score NaN, one of 1e-300 turned the softcap
// off. Such a backend declines them (the reference takes any finite value).
#pragma once

#include <cfloat>
#include <cstdio>
#include <string>

#include "flce/flce.h"

namespace flce {

// "" or why `backend` declines the options.
inline std::string float32_options_problem(const Options& o, const char* backend) {
  const struct {
    const char* name;
    double value;
    bool zero_is_off;
  } scalars[] = {{"logit_scale", o.logit_scale, false}, {"softcap", o.softcap, true}};
  for (const auto& s : scalars) {
    if (s.zero_is_off && s.value == 0) continue;
    if (s.value >= FLT_MIN && s.value <= FLT_MAX) continue;
    char text[200];
    std::snprintf(text, sizeof text,
                  "%s = %g is outside float32's normal range [%g, %g], in which the %s backend "
                  "computes (the reference backend takes it)",
                  s.name, s.value, double(FLT_MIN), double(FLT_MAX), backend);
    return text;
  }
  return "";
}

}  // namespace flce
