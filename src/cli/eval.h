// `flce eval`: evaluation at scale. Streams hidden states and labels from
// memory-mapped .npy files in row blocks through flce::forward and prints
// the mean loss, perplexity, top-1 accuracy and mean entropy; optionally
// writes per-token log-probabilities, entropies and argmaxes, block by
// block. Memory does not grow with the number of rows.
#pragma once

namespace flce::cli {

int eval_command(int argc, char** argv, int first);
const char* eval_usage();

}  // namespace flce::cli
