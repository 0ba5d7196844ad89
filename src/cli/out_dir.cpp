#include "cli/out_dir.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>

#include "cli/inputs.h"

namespace flce::cli {
namespace fs = std::filesystem;

namespace {

// Every file name `flce run` or `flce eval` may write.
constexpr const char* kOutputFiles[] = {
    "loss.npy",   "lse.npy",    "logprob.npy",   "argmax.npy",      "entropy.npy",
    "zloss.npy",  "grad_x.npy", "grad_w.npy",    "grad_bias.npy",   "grad_logits.npy"};

// "HOST.NS.": where a process runs, for the hidden names. HOST is this
// machine's name (an --out on shared storage), with characters outside
// [A-Za-z0-9._-] as '_' (a '/' would make a path); NS is the pid namespace
// (containers of one host that share its name need not share its pids:
// another namespace's process is never taken for gone).
const std::string& owner_place() {
  static const std::string place = [] {
    char host[256] = "";
    std::string tag = ::gethostname(host, sizeof host - 1) == 0 && host[0] ? host : "localhost";
    for (char& c : tag)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '_') c = '_';
    char ns[64] = "";
    const ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof ns - 1);  // "pid:[4026531836]"
    std::string digits;
    for (ssize_t k = 0; k < std::max<ssize_t>(n, 0); ++k)
      if (std::isdigit(static_cast<unsigned char>(ns[k]))) digits += ns[k];
    return tag + "." + (digits.empty() ? "0" : digits) + ".";
  }();
  return place;
}

// Whether `entry` is a hidden file of an output name that a flce process of
// this host and pid namespace left, and that process is no longer running.
bool left_by_a_dead_process(const std::string& entry) {
  for (const char* file : kOutputFiles)
    for (const char* kind : {"tmp", "old"}) {
      std::string prefix(".");  // ".loss.npy.tmp.HOST.NS."
      prefix.append(file).append(".").append(kind).append(".").append(owner_place());
      if (entry.size() <= prefix.size() || entry.compare(0, prefix.size(), prefix) != 0) continue;
      const std::string digits = entry.substr(prefix.size());
      if (digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos)
        return false;
      const pid_t pid = static_cast<pid_t>(std::stol(digits));
      return pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH;
    }
  return false;
}

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

void make_out_dir(const std::string& dir, const char* command) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw Failure{"--out " + dir + ": cannot create the directory" +
                  (ec ? " (" + ec.message() + ")" : std::string(" (a file is in the way)"))};
  std::vector<std::string> removed;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string entry = it->path().filename().string();
    std::error_code ignored;
    if (left_by_a_dead_process(entry) && fs::remove(it->path(), ignored)) removed.push_back(entry);
  }
  if (removed.empty()) return;
  std::sort(removed.begin(), removed.end());
  std::fprintf(stderr, "%s: note: removed %s from --out %s (left by a flce process of this host "
               "that is no longer running)\n", command, name_list(removed).c_str(), dir.c_str());
}

std::string hidden_name(const std::string& name, const char* kind, long pid) {
  return "." + name + "." + kind + "." + owner_place() + std::to_string(pid);
}

std::string name_list(const std::vector<std::string>& names) {
  std::string list;
  for (const std::string& name : names) list += (list.empty() ? "" : ", ") + name;
  return list;
}

fs::path temporary_path(const std::string& dir, const std::string& name) {
  return fs::path(dir) / hidden_name(name, "tmp", ::getpid());
}

std::vector<std::string> commit_outputs(const std::string& dir, const Renames& renames,
                                        const std::vector<std::string>& inputs,
                                        bool remove_others,
                                        std::vector<std::string>* not_removed) {
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
  for (size_t k = 0; k < renames.size(); ++k) {
    const auto& [tmp, final_path] = renames[k];
    if (fs::symlink_status(final_path, ec).type() != fs::file_type::not_found) {
      const std::string name = final_path.filename().string();
      kept[k] = final_path.parent_path() / hidden_name(name, "old", ::getpid());
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
    if (!remove_others || fs::remove(other, ec)) others.push_back(file);
    else if (not_removed) not_removed->push_back(std::string(file) + ": " + ec.message());
  }
  return others;
}

}  // namespace flce::cli
