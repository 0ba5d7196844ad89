// commit_outputs (src/cli/out_dir.h), the step `flce run` and `flce eval`
// end with: their outputs go into --out all together or not at all.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <filesystem>
#include <map>
#include <string>

#include "cli/inputs.h"
#include "cli/out_dir.h"
#include "support/npy_files.h"

namespace {

namespace fs = std::filesystem;
using flce::cli::commit_outputs;
using flce::cli::Failure;
using flce::cli::Renames;
using flce_test::Bytes;
using flce_test::snapshot_dir;
using flce_test::write_bytes;

// Expects commit_outputs to throw a Failure that mentions `needle`.
void expect_failure(const std::string& dir, const Renames& renames, const std::string& needle) {
  try {
    commit_outputs(dir, renames, {}, true);
    ADD_FAILURE() << "no Failure";
  } catch (const Failure& f) {
    EXPECT_NE(f.message.find(needle), std::string::npos) << f.message;
  }
}

TEST(OutDir, AFailedRenameLeavesEveryEarlierOutputAsItWas) {
  // zloss.npy's temporary file is missing, so its rename fails after
  // loss.npy's new file replaced the old one and lse.npy's new file went
  // where there was none: loss.npy holds the old bytes again, lse.npy and
  // every temporary and kept copy are gone.
  flce_test::TempDir dir;
  write_bytes(dir.file("loss.npy"), Bytes{1});
  write_bytes(dir.file("zloss.npy"), Bytes{2});
  write_bytes(dir.file("grad_w.npy"), Bytes{3});  // another command's: stays after a failure
  const auto before = snapshot_dir(dir.path());
  write_bytes(dir.file(".loss.npy.tmp"), Bytes{4});
  write_bytes(dir.file(".lse.npy.tmp"), Bytes{5});
  expect_failure(dir.path(),
                 {{dir.file(".loss.npy.tmp"), dir.file("loss.npy")},
                  {dir.file(".lse.npy.tmp"), dir.file("lse.npy")},
                  {dir.file(".zloss.npy.tmp"), dir.file("zloss.npy")}},
                 "cannot rename " + dir.file(".zloss.npy.tmp"));
  EXPECT_EQ(snapshot_dir(dir.path()), before);
}

TEST(OutDir, ADirectoryAtAFinalNameStopsTheCommitBeforeAnyRename) {
  flce_test::TempDir dir;
  write_bytes(dir.file("loss.npy"), Bytes{1});
  fs::create_directory(dir.file("lse.npy"));
  write_bytes(dir.file(".loss.npy.tmp"), Bytes{4});
  write_bytes(dir.file(".lse.npy.tmp"), Bytes{5});
  expect_failure(dir.path(),
                 {{dir.file(".loss.npy.tmp"), dir.file("loss.npy")},
                  {dir.file(".lse.npy.tmp"), dir.file("lse.npy")}},
                 "lse.npy exists and is not a regular file");
  const std::map<std::string, Bytes> expected = {{"loss.npy", Bytes{1}}, {"lse.npy", {}}};
  EXPECT_EQ(snapshot_dir(dir.path()), expected);
  EXPECT_TRUE(fs::is_directory(dir.file("lse.npy")));
}

TEST(OutDir, ADanglingSymlinkAtAFinalNameIsPutBackOnFailure) {
  flce_test::TempDir dir;
  fs::create_symlink("nowhere.npy", dir.file("loss.npy"));
  write_bytes(dir.file(".loss.npy.tmp"), Bytes{4});
  expect_failure(dir.path(),
                 {{dir.file(".loss.npy.tmp"), dir.file("loss.npy")},
                  {dir.file(".lse.npy.tmp"), dir.file("lse.npy")}},
                 "cannot rename");
  ASSERT_TRUE(fs::is_symlink(dir.file("loss.npy")));
  EXPECT_EQ(fs::read_symlink(dir.file("loss.npy")), "nowhere.npy");
  const std::map<std::string, Bytes> expected = {{"loss.npy", {}}};  // the link only
  EXPECT_EQ(snapshot_dir(dir.path()), expected);
}

// ".NAME.KIND.HOST.NS.PID" for process `pid` of this host and pid
// namespace, or of another place.
std::string hidden(const std::string& name, const std::string& kind, pid_t pid,
                   const std::string& elsewhere = "") {
  if (elsewhere.empty()) return flce::cli::hidden_name(name, kind.c_str(), pid);
  return "." + name + "." + kind + "." + elsewhere + "." + std::to_string(pid);
}

// "HOST.NS": this host and pid namespace as hidden names carry them.
std::string own_place() {
  const std::string name = hidden("x", "tmp", 1);  // ".x.tmp.HOST.NS.1"
  return name.substr(7, name.size() - 7 - 2);
}

// The pid of a process that has exited and been reaped.
pid_t a_dead_pid() {
  const pid_t pid = ::fork();
  if (pid == 0) ::_exit(0);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return pid;
}

TEST(OutDir, TemporaryFilesAreHiddenAndNameTheirHostNamespaceAndProcess) {
  EXPECT_EQ(flce::cli::temporary_path("d", "loss.npy"),
            fs::path("d") / hidden("loss.npy", "tmp", ::getpid()));
  char host[256] = "";
  ASSERT_EQ(::gethostname(host, sizeof host - 1), 0);
  std::string expected = ".loss.npy.tmp.";
  for (const char* c = host; *c; ++c)
    expected += std::isalnum(static_cast<unsigned char>(*c)) || *c == '.' || *c == '-' ? *c : '_';
  const std::string name = hidden("loss.npy", "tmp", 1234);
  EXPECT_EQ(name.compare(0, expected.size() + 1, expected + "."), 0) << name;
  EXPECT_EQ(name.substr(name.size() - 5), ".1234") << name;
  EXPECT_EQ(name.find('/'), std::string::npos) << name;
}

TEST(OutDir, WhatAProcessThatIsGoneLeftIsRemovedWithANote) {
  // A flce process killed mid-write (SIGKILL, the OOM killer) leaves its
  // hidden files; the next command into DIR removes those of this host and
  // pid namespace whose process is gone, and only those.
  flce_test::TempDir dir;
  const pid_t dead = a_dead_pid();
  const std::string gone_tmp = hidden("logprob.npy", "tmp", dead);
  const std::string gone_old = hidden("loss.npy", "old", dead);
  write_bytes(dir.file(gone_tmp), Bytes{1});
  write_bytes(dir.file(gone_old), Bytes{2});
  std::map<std::string, Bytes> kept = {
      {hidden("loss.npy", "tmp", ::getpid()), Bytes{3}},          // a running process's
      {hidden("loss.npy", "tmp", dead, "elsewhere.1"), Bytes{4}},  // another host's
      {hidden("loss.npy", "tmp", dead, own_place() + "9"), Bytes{8}},  // another pid namespace's
      {hidden("notes.txt", "tmp", dead), Bytes{5}},               // not an output name
      {hidden("loss.npy", "tmp", dead) + "x", Bytes{6}},          // not a pid
      {"loss.npy", Bytes{7}}};
  for (const auto& [name, bytes] : kept) write_bytes(dir.file(name), bytes);
  testing::internal::CaptureStderr();
  flce::cli::make_out_dir(dir.path(), "flce eval");
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(snapshot_dir(dir.path()), kept);
  EXPECT_NE(err.find("flce eval: note: removed "), std::string::npos) << err;
  EXPECT_NE(err.find(gone_tmp), std::string::npos) << err;
  EXPECT_NE(err.find(gone_old), std::string::npos) << err;
  EXPECT_NE(err.find("left by a flce process of this host that is no longer running"),
            std::string::npos) << err;
  // Nothing to remove: no note.
  testing::internal::CaptureStderr();
  flce::cli::make_out_dir(dir.path(), "flce eval");
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
}

TEST(OutDir, AKeptCopyAKilledRunLeftIsReplaced) {
  // A run killed mid-commit leaves ".loss.npy.old.HOST.NS.PID"; a later run
  // of the same pid must not fail on it (nor leave it).
  flce_test::TempDir dir;
  write_bytes(dir.file("loss.npy"), Bytes{1});
  write_bytes(dir.file(hidden("loss.npy", "old", ::getpid())), Bytes{9});
  write_bytes(dir.file(".loss.npy.tmp"), Bytes{4});
  commit_outputs(dir.path(), {{dir.file(".loss.npy.tmp"), dir.file("loss.npy")}}, {}, true);
  const std::map<std::string, Bytes> expected = {{"loss.npy", Bytes{4}}};
  EXPECT_EQ(snapshot_dir(dir.path()), expected);
}

TEST(OutDir, ACommitReplacesAndRemovesOrReportsOnlyOtherOutputs) {
  for (bool remove_others : {true, false}) {
    SCOPED_TRACE(remove_others ? "remove_others" : "report them");
    flce_test::TempDir dir;
    write_bytes(dir.file("loss.npy"), Bytes{1});         // replaced
    write_bytes(dir.file("grad_w.npy"), Bytes{2});       // an output this commit lacks
    write_bytes(dir.file("grad_logits.npy"), Bytes{3});  // one of the inputs: kept
    write_bytes(dir.file("notes.txt"), Bytes{4});        // not an output name: kept
    write_bytes(dir.file(".loss.npy.tmp"), Bytes{5});
    write_bytes(dir.file(".lse.npy.tmp"), Bytes{6});
    const auto others = commit_outputs(dir.path(),
                                       {{dir.file(".loss.npy.tmp"), dir.file("loss.npy")},
                                        {dir.file(".lse.npy.tmp"), dir.file("lse.npy")}},
                                       {dir.file("grad_logits.npy")}, remove_others);
    std::map<std::string, Bytes> expected = {{"loss.npy", Bytes{5}},
                                             {"lse.npy", Bytes{6}},
                                             {"grad_logits.npy", Bytes{3}},
                                             {"notes.txt", Bytes{4}}};
    if (!remove_others) expected["grad_w.npy"] = Bytes{2};
    EXPECT_EQ(snapshot_dir(dir.path()), expected);
    EXPECT_EQ(others, std::vector<std::string>{"grad_w.npy"});  // removed, or there
  }
}

TEST(OutDir, AnOtherOutputThatCannotBeRemovedIsReportedAndTheCommitStands) {
  flce_test::TempDir dir;
  write_bytes(dir.file("grad_w.npy"), Bytes{2});  // an output this commit lacks
  write_bytes(dir.file(".loss.npy.tmp"), Bytes{5});
  // Even root cannot remove an immutable file: the one way to make the
  // remove fail here while the rename beside it succeeds.
  const flce_test::ImmutableFile pinned(dir.file("grad_w.npy"));
  if (!pinned.ok()) GTEST_SKIP() << "cannot set the immutable flag here (needs root and ext4/xfs/btrfs)";
  std::vector<std::string> not_removed;
  const auto others = commit_outputs(dir.path(), {{dir.file(".loss.npy.tmp"), dir.file("loss.npy")}},
                                     {}, /*remove_others=*/true, &not_removed);
  EXPECT_EQ(others, std::vector<std::string>{});
  ASSERT_EQ(not_removed.size(), 1u);
  EXPECT_EQ(not_removed[0].rfind("grad_w.npy: ", 0), 0u) << not_removed[0];
  EXPECT_EQ(snapshot_dir(dir.path()),
            (std::map<std::string, Bytes>{{"loss.npy", Bytes{5}}, {"grad_w.npy", Bytes{2}}}));
}

}  // namespace
