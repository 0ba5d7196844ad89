#include "support/shared_cases.h"

namespace flce_test {

using flce::Reduction;
using flce::WeightLayout;

std::vector<Case> each_option_alone(HeadMaker head) {
  std::vector<Case> cases = {
      head(5, 7, 11, 1),
      head(5, 6, 9, 1).logit_scale(0.6),
      head(5, 6, 9, 1).softcap(2.5).logit_magnitude(8),
      head(5, 6, 9, 1).label_smoothing(0.2),
      head(5, 6, 9, 1).z_loss(0.05),
      head(5, 6, 9, 1).with_bias(),
      head(5, 6, 9, 1).with_token_weights(),
      head(5, 6, 9, 1).with_class_weights().label_smoothing(0.1),
      head(5, 6, 9, 1).with_class_weights().label_smoothing(1),  // all uniform, as torch allows
      head(5, 6, 9, 1).ignore_index(3).ignore_rows({0, 4}),
      head(5, 6, 9, 1).layout(WeightLayout::hv),
  };
  for (Reduction r : {Reduction::none, Reduction::sum, Reduction::mean})
    cases.push_back(
        head(5, 6, 9, 1).reduction(r).with_grad_loss().with_grad_lse().with_grad_entropy());
  return cases;
}

std::vector<Case> large_logit_cases(HeadMaker head, LogitsMaker logits, int64_t rows,
                                    int64_t wide_v) {
  std::vector<Case> cases;
  for (double m : {100.0, 1000.0}) {
    cases.push_back(head(rows, 6, wide_v, 1).with_bias().logit_magnitude(m));
    cases.push_back(
        head(rows, 6, 40, 1).logit_magnitude(m).label_smoothing(0.1).with_grad_entropy());
    cases.push_back(head(rows, 6, 40, 1).logit_magnitude(m).softcap(30));
    cases.push_back(logits(rows, 40, 1).logit_magnitude(m).with_grad_lse());
  }
  return cases;
}

std::vector<Case> all_rows_ignored(HeadMaker head) {
  return {head(4, 5, 9, 1).ignore_rows({0, 1, 2, 3}),
          head(4, 5, 9, 1).ignore_rows({0, 1, 2, 3}).with_grad_lse().with_grad_entropy()};
}

}  // namespace flce_test
