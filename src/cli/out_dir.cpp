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

// Puts back what the renames before `done` replaced, then removes the
// temporaries; best effort, since it runs after a failure.
void roll_back(const Renames& renames, const std::vector<fs::path>& aside, size_t done) {
  std::error_code ignored;
  for (size_t k = 0; k < done; ++k) {
    if (!aside[k].empty()) fs::rename(aside[k], renames[k].second, ignored);
    else fs::remove(renames[k].second, ignored);
  }
  for (size_t k = done; k < renames.size(); ++k) {
    if (!aside[k].empty()) fs::rename(aside[k], renames[k].second, ignored);
    fs::remove(renames[k].first, ignored);
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

void commit_outputs(const std::string& dir, const Renames& renames,
                    const std::vector<std::string>& inputs) {
  std::error_code ec;
  auto fail = [&](size_t done, const std::vector<fs::path>& aside, const std::string& why) {
    roll_back(renames, aside, done);
    throw Failure{"--out: " + why};
  };
  std::vector<fs::path> aside(renames.size());  // where a replaced file waits
  for (const auto& [tmp, final_path] : renames)
    if (fs::exists(final_path, ec) && !fs::is_regular_file(final_path, ec))
      fail(0, aside, final_path.string() + " exists and is not a regular file");
  const std::string suffix = ".old" + std::to_string(::getpid());
  for (size_t k = 0; k < renames.size(); ++k) {
    const auto& [tmp, final_path] = renames[k];
    if (fs::exists(final_path, ec)) {
      std::string hidden(".");  // ".grad_w.npy.old1234"
      hidden.append(final_path.filename().string()).append(suffix);
      const fs::path old = final_path.parent_path() / hidden;
      fs::rename(final_path, old, ec);
      if (ec) fail(k, aside, "cannot move " + final_path.string() + " aside: " + ec.message());
      aside[k] = old;
    }
    fs::rename(tmp, final_path, ec);
    if (ec)
      fail(k, aside, "cannot rename " + tmp.string() + " to " + final_path.string() + ": " +
                         ec.message());
  }
  for (const fs::path& old : aside)
    if (!old.empty()) fs::remove(old, ec);
  for (const char* file : kOutputFiles) {
    bool ours = false;
    for (const auto& entry : renames) ours |= entry.second.filename() == file;
    const fs::path stale = fs::path(dir) / file;
    for (const std::string& input : inputs) ours |= fs::equivalent(stale, input, ec);
    if (!ours && fs::is_regular_file(stale, ec)) fs::remove(stale, ec);
  }
}

}  // namespace flce::cli
