#include "cli/out_dir.h"

#include <unistd.h>

#include "cli/inputs.h"

namespace flce::cli {
namespace fs = std::filesystem;

namespace {

// Every file name `flce run` or `flce eval` may write.
constexpr const char* kOutputFiles[] = {
    "loss.npy",   "lse.npy",    "logprob.npy",   "argmax.npy",      "entropy.npy",
    "zloss.npy",  "grad_x.npy", "grad_w.npy",    "grad_bias.npy",   "grad_logits.npy"};

// Keeps what is at `final_path` as `kept` (a hard link, else a copy of a
// regular file) so that the rename over it stays atomic (the final name is
// never missing) and a later failure can put it back. "" or the error.
std::string keep(const fs::path& final_path, const fs::path& kept) {
  std::error_code ec;
  fs::remove(kept, ec);  // one a killed run of the same pid left
  fs::create_hard_link(final_path, kept, ec);
  if (ec && fs::is_regular_file(fs::symlink_status(final_path)))
    fs::copy_file(final_path, kept, ec);
  return ec ? "cannot keep a copy of " + final_path.string() + " to put back on failure: " +
                  ec.message()
            : "";
}

// After a failure at renames[done]: puts back what the renames before it
// replaced (or removes what they added), then removes the temporaries and
// the kept copies; best effort.
void roll_back(const Renames& renames, const std::vector<fs::path>& kept, size_t done) {
  std::error_code ignored;
  for (size_t k = 0; k < renames.size(); ++k) {
    if (k < done && !kept[k].empty()) fs::rename(kept[k], renames[k].second, ignored);
    else if (k < done) fs::remove(renames[k].second, ignored);
    else if (!kept[k].empty()) fs::remove(kept[k], ignored);
    if (k >= done) fs::remove(renames[k].first, ignored);
  }
}

}  // namespace

void make_out_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw Failure{"--out " + dir + ": cannot create the directory" +
                  (ec ? " (" + ec.message() + ")" : std::string(" (a file is in the way)"))};
}

std::vector<std::string> commit_outputs(const std::string& dir, const Renames& renames,
                                        const std::vector<std::string>& inputs,
                                        bool remove_others) {
  std::error_code ec;
  std::vector<fs::path> kept(renames.size());  // where a replaced file's copy waits
  auto fail = [&](size_t done, const std::string& why) {
    roll_back(renames, kept, done);
    throw Failure{"--out: " + why};
  };
  for (const auto& [tmp, final_path] : renames) {
    const fs::file_type type = fs::symlink_status(final_path, ec).type();
    if (type != fs::file_type::not_found && type != fs::file_type::regular &&
        type != fs::file_type::symlink)
      fail(0, final_path.string() + " exists and is not a regular file");
  }
  const std::string suffix = ".old" + std::to_string(::getpid());
  for (size_t k = 0; k < renames.size(); ++k) {
    const auto& [tmp, final_path] = renames[k];
    if (fs::symlink_status(final_path, ec).type() != fs::file_type::not_found) {
      std::string hidden(".");  // ".grad_w.npy.old1234"
      hidden.append(final_path.filename().string()).append(suffix);
      kept[k] = final_path.parent_path() / hidden;
      if (auto e = keep(final_path, kept[k]); !e.empty()) {
        kept[k].clear();
        fail(k, e);
      }
    }
    fs::rename(tmp, final_path, ec);
    if (ec)
      fail(k, "cannot rename " + tmp.string() + " to " + final_path.string() + ": " +
                  ec.message());
  }
  for (const fs::path& old : kept)
    if (!old.empty()) fs::remove(old, ec);
  std::vector<std::string> others;
  for (const char* file : kOutputFiles) {
    bool ours = false;
    for (const auto& entry : renames) ours |= entry.second.filename() == file;
    const fs::path other = fs::path(dir) / file;
    for (const std::string& input : inputs) ours |= fs::equivalent(other, input, ec);
    if (ours || !fs::is_regular_file(other, ec)) continue;
    if (remove_others) fs::remove(other, ec);
    else others.push_back(file);
  }
  return others;
}

}  // namespace flce::cli
