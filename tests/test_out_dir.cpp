// commit_outputs (src/cli/out_dir.h), the step `flce run` and `flce eval`
// end with: their outputs go into --out all together or not at all.
#include <gtest/gtest.h>

#include <filesystem>
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
using flce_test::read_bytes;
using flce_test::snapshot_dir;
using flce_test::write_bytes;

TEST(OutDir, AFailedRenameLeavesEveryEarlierOutputAsItWas) {
  // lse.npy's temporary file is missing, so its rename fails after
  // loss.npy's new file went in: loss.npy must hold the old bytes again.
  flce_test::TempDir dir;
  write_bytes(dir.file("loss.npy"), Bytes{1});
  write_bytes(dir.file("lse.npy"), Bytes{2});
  write_bytes(dir.file("grad_w.npy"), Bytes{3});  // another command's: stays after a failure
  write_bytes(dir.file(".loss.npy.tmp"), Bytes{4});
  const auto before = snapshot_dir(dir.path());
  const Renames renames = {{dir.file(".loss.npy.tmp"), dir.file("loss.npy")},
                           {dir.file(".lse.npy.tmp"), dir.file("lse.npy")}};
  try {
    commit_outputs(dir.path(), renames, {});
    ADD_FAILURE() << "no Failure";
  } catch (const Failure& f) {
    EXPECT_NE(f.message.find("cannot rename " + dir.file(".lse.npy.tmp")), std::string::npos)
        << f.message;
  }
  auto after = snapshot_dir(dir.path());
  EXPECT_EQ(after.erase(".loss.npy.tmp"), 0u) << "the temporary file was left";
  auto expected = before;
  expected.erase(".loss.npy.tmp");
  EXPECT_EQ(after, expected);
}

TEST(OutDir, ACommitReplacesAndRemovesOnlyOutputFiles) {
  flce_test::TempDir dir;
  write_bytes(dir.file("loss.npy"), Bytes{1});         // replaced
  write_bytes(dir.file("grad_w.npy"), Bytes{2});       // an output this commit lacks: removed
  write_bytes(dir.file("grad_logits.npy"), Bytes{3});  // one of the inputs: kept
  write_bytes(dir.file("notes.txt"), Bytes{4});        // not an output name: kept
  write_bytes(dir.file(".loss.npy.tmp"), Bytes{5});
  write_bytes(dir.file(".lse.npy.tmp"), Bytes{6});
  commit_outputs(dir.path(),
                 {{dir.file(".loss.npy.tmp"), dir.file("loss.npy")},
                  {dir.file(".lse.npy.tmp"), dir.file("lse.npy")}},
                 {dir.file("grad_logits.npy")});
  const auto after = snapshot_dir(dir.path());
  const std::map<std::string, Bytes> expected = {{"loss.npy", Bytes{5}},
                                                 {"lse.npy", Bytes{6}},
                                                 {"grad_logits.npy", Bytes{3}},
                                                 {"notes.txt", Bytes{4}}};
  EXPECT_EQ(after, expected);
}

}  // namespace
