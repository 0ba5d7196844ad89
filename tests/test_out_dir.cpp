// commit_outputs (src/cli/out_dir.h), the step `flce run` and `flce eval`
// end with: their outputs go into --out all together or not at all.
#include <gtest/gtest.h>
#include <unistd.h>

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

TEST(OutDir, AKeptCopyAKilledRunLeftIsReplaced) {
  // A run killed mid-commit leaves ".loss.npy.old<pid>"; a later run of the
  // same pid must not fail on it (nor leave it).
  flce_test::TempDir dir;
  write_bytes(dir.file("loss.npy"), Bytes{1});
  write_bytes(dir.file(".loss.npy.old" + std::to_string(::getpid())), Bytes{9});
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
    EXPECT_EQ(others, remove_others ? std::vector<std::string>{}
                                    : std::vector<std::string>{"grad_w.npy"});
  }
}

}  // namespace
