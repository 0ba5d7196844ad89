// How `flce run` and `flce eval` put their finished outputs into --out DIR:
// all of them or none, and nothing left from an earlier command.
#pragma once

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace flce::cli {

// Creates DIR if missing; throws Failure naming --out if it cannot.
void make_out_dir(const std::string& dir);

// The files are complete under temporary names in DIR: (temporary, final).
// Renames each onto its final name, all or none: a file already at a final
// name is first moved aside and put back if a later rename fails (then the
// temporaries are removed and Failure is thrown). Afterwards removes every
// other file name either command may write (grad_w.npy after an eval, say),
// except a file that is one of `inputs` (`--logits DIR/grad_logits.npy`),
// so DIR holds one command's outputs.
using Renames = std::vector<std::pair<std::filesystem::path, std::filesystem::path>>;
void commit_outputs(const std::string& dir, const Renames& renames,
                    const std::vector<std::string>& inputs);

}  // namespace flce::cli
