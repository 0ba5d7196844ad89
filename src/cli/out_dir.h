// How `flce run` and `flce eval` put their finished outputs into --out DIR:
// all of them or none.
#pragma once

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace flce::cli {

// Creates DIR if missing (throws Failure naming --out if it cannot), and
// removes what a flce process of this host that is no longer running left
// there (killed mid-write: its hidden temporary and kept files), with a
// note on stderr naming them after `command` ("flce eval").
void make_out_dir(const std::string& dir, const char* command);

// ".NAME.KIND.HOST.NS.PID": the hidden name under which process `pid` of
// this host (its name) and pid namespace (NS) writes output NAME (KIND tmp)
// or keeps a file its commit replaces (KIND old); they tell a later command
// whose it was.
std::string hidden_name(const std::string& name, const char* kind, long pid);

// "a, b, c": file names for a note.
std::string name_list(const std::vector<std::string>& names);

// DIR/hidden_name(NAME, "tmp", this process): where it writes output NAME
// until the commit.
std::filesystem::path temporary_path(const std::string& dir, const std::string& name);

// The files are complete under temporary names in DIR: (temporary, final).
// Renames each onto its final name, all or none: a file already at a final
// name is first kept as a hard link (else a copy), so that each rename stays
// atomic, and put back if a later rename fails (then the temporaries are
// removed and Failure is thrown). Then, of the other file names either
// command may write (grad_w.npy beside an eval's outputs, say), except a
// file that is one of `inputs` (`--logits DIR/grad_logits.npy`): removes
// them if `remove_others` (`flce run`: DIR holds one run's outputs) and
// returns those removed (and, in *not_removed, "NAME: why" of those it
// could not remove), else returns those present.
using Renames = std::vector<std::pair<std::filesystem::path, std::filesystem::path>>;
std::vector<std::string> commit_outputs(const std::string& dir, const Renames& renames,
                                        const std::vector<std::string>& inputs,
                                        bool remove_others,
                                        std::vector<std::string>* not_removed = nullptr);

}  // namespace flce::cli
