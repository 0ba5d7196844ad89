// The 16-bit score codes of both backends (the cpu backend's packed scores,
// the cuda backend's stash): f16(ref - s), ref the largest score of a group.
#pragma once

namespace flce {

// Whether codes can hold the scores under a softcap of k (0: none). Every
// softcapped score lies in [-k, k], so ref - s <= 2k fits f16's 65504 for
// k <= 32752. Beyond, a difference can overflow f16 and read back as another
// s (or -inf), where p is 0 all the same but ds/dz = 1 - (s/k)^2, which
// reads s itself, is not: the label's column and label smoothing's terms of
// G would be wrong (22% at k = 1e5, a bf16 score of -46212).
inline bool codes_hold_softcap(double k) { return k <= 32752; }

}  // namespace flce
