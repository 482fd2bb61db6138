// The worker's per-step checkpoint files: names, and pruning that touches only this worker's
// well-formed files (another worker's, a temp file or an odd name stay).
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "worker/daemon/rank_checkpoints.h"

namespace geofp8::worker {
namespace {

namespace fs = std::filesystem;

TEST(CheckpointFiles, PruneRemovesOnlyThisWorkersSelectedSteps) {
  std::string tmpl = (fs::temp_directory_path() / "geofp8-ckpt-XXXXXX").string();
  ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
  struct Dir {
    std::string p;
    const std::string& path() const { return p; }
    ~Dir() {
      std::error_code ec;
      fs::remove_all(p, ec);
    }
  } dir{tmpl};
  EXPECT_EQ(CheckpointFile(dir.path(), "w0", 40), (fs::path(dir.path()) / "w0.40.ckpt").string());
  const std::vector<std::string> files = {
      "w0.10.ckpt", "w0.20.ckpt", "w0.30.ckpt", "w0.40.ckpt",  "w0.20.ckpt.tmp",
      "w0.x.ckpt",  "w0..ckpt",   "w0.5.ckpt",  "w01.10.ckpt", "w0.7.10.ckpt"};
  for (const auto& f : files) std::ofstream(fs::path(dir.path()) / f) << "x";
  EXPECT_EQ(PruneCheckpoints(dir.path(), "w0", [](int64_t s) { return s < 30; }), 3);
  std::set<std::string> left;
  for (const auto& e : fs::directory_iterator(dir.path())) left.insert(e.path().filename());
  EXPECT_EQ(left, (std::set<std::string>{"w0.30.ckpt", "w0.40.ckpt", "w0.20.ckpt.tmp", "w0.x.ckpt",
                                         "w0..ckpt", "w01.10.ckpt", "w0.7.10.ckpt"}));
  // A worker named "w0.7" owns its own files only.
  EXPECT_EQ(PruneCheckpoints(dir.path(), "w0.7", [](int64_t) { return true; }), 1);
  EXPECT_EQ(PruneCheckpoints(dir.path() + "/missing", "w0", [](int64_t) { return true; }), 0);
  // What a worker reports when it registers again: its own well-formed files, ascending.
  EXPECT_EQ(ListCheckpoints(dir.path(), "w0"), (std::vector<int64_t>{30, 40}));
  EXPECT_EQ(ListCheckpoints(dir.path(), "w01"), (std::vector<int64_t>{10}));
  EXPECT_TRUE(ListCheckpoints(dir.path() + "/missing", "w0").empty());
}

}  // namespace
}  // namespace geofp8::worker
