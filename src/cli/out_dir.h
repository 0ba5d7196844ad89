// How `flce run` and `flce eval` put their finished outputs into --out DIR:
// all of them or none.
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
// name is first kept as a hard link (else a copy), so that each rename stays
// atomic, and put back if a later rename fails (then the temporaries are
// removed and Failure is thrown). Then, of the other file names either
// command may write (grad_w.npy beside an eval's outputs, say), except a
// file that is one of `inputs` (`--logits DIR/grad_logits.npy`): removes
// them if `remove_others` (`flce run`: DIR holds one run's outputs), else
// returns those present.
using Renames = std::vector<std::pair<std::filesystem::path, std::filesystem::path>>;
std::vector<std::string> commit_outputs(const std::string& dir, const Renames& renames,
                                        const std::vector<std::string>& inputs,
                                        bool remove_others);

}  // namespace flce::cli
