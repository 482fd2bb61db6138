// geofp8-bench geometry --grads/--grads-stale, end to end on a dump folder laid out as
// geofp8-train --dump-grads writes it: the quality table, 1-D layers skipped, bad dumps rejected.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "kernels/geometry/synthetic.h"

namespace geofp8 {
namespace {

struct Result {
  int code;
  std::string out, err;
};

class BenchGradsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/geofp8_bench_grads_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    // Step folders as geofp8-train writes them: shapes.json plus one float32 file per layer.
    for (const char* step : {"step_9", "step_10"}) {
      ASSERT_EQ(std::system(("mkdir -p " + dir_ + "/" + step).c_str()), 0);
      const double drift = std::string(step) == "step_9" ? 0.05 : 0.0;
      Write(std::string(step) + "/w.avg.f32",
            MakeSyntheticGradient({SyntheticFamily::kSpectral, 96, 64, 2.0, 3, drift}));
      Write(std::string(step) + "/bias.avg.f32", std::vector<float>(64, 0.5f));
      std::ofstream(dir_ + "/" + step + "/shapes.json")
          << "{\n  \"step\": 10,\n  \"layers\": [\n"
          << "    {\"name\": \"w\", \"rows\": 96, \"cols\": 64, \"avg\": \"w.avg.f32\", "
             "\"per_rank\": [\"w.rank0.f32\"]},\n"
          << "    {\"name\": \"bias\", \"rows\": 1, \"cols\": 64, \"avg\": \"bias.avg.f32\", "
             "\"per_rank\": []}\n  ]\n}\n";
    }
  }
  void TearDown() override { std::system(("rm -rf " + dir_).c_str()); }

  void Write(const std::string& name, const std::vector<float>& x) const {
    std::ofstream os(dir_ + "/" + name, std::ios::binary);
    os.write(reinterpret_cast<const char*>(x.data()), 4 * x.size());
  }
  static std::string Slurp(const std::string& path) {
    std::ifstream is(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(is), {}};
  }
  Result Run(const std::string& args) const {
    const std::string cmd = std::string(GEOFP8_BENCH_PATH) + " geometry " + args + " >" + dir_ +
                            "/stdout 2>" + dir_ + "/stderr";
    const int status = std::system(cmd.c_str());
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, Slurp(dir_ + "/stdout"),
            Slurp(dir_ + "/stderr")};
  }

  std::string dir_;
};

TEST_F(BenchGradsTest, PrintsTheQualityTableForEveryMatrixWithAStaleBasis) {
  const Result r = Run("--grads " + dir_ + "/step_10 --grads-stale " + dir_ + "/step_9");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("1 1-D layer(s) skipped"), std::string::npos) << r.out;
  // One row per codec for the matrix, none for the bias; a p^-2 spectrum with a slightly drifted
  // basis meets the target fresh and stale on all three codecs.
  size_t rows = 0;
  for (size_t p = r.out.find("| w 96x64 |"); p != std::string::npos;
       p = r.out.find("| w 96x64 |", p + 1)) {
    ++rows;
    const size_t eol = r.out.find('\n', p);
    EXPECT_NE(r.out.substr(p, eol - p).find("| yes/yes |"), std::string::npos)
        << r.out.substr(p, eol - p);
  }
  EXPECT_EQ(rows, 3u) << r.out;
  EXPECT_EQ(r.out.find("| bias"), std::string::npos);
  EXPECT_NE(r.out.find("target met on 6 of 6"), std::string::npos) << r.out;
}

TEST_F(BenchGradsTest, WithoutStaleOnlyTheFreshColumnsAreFilled) {
  const Result r = Run("--grads " + dir_ + "/step_10");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("target met on 3 of 3"), std::string::npos) << r.out;
}

TEST_F(BenchGradsTest, BadDumpsAreOneLineUsageErrors) {
  Write("step_10/w.avg.f32", std::vector<float>(10, 1.f));  // short file
  Result r = Run("--grads " + dir_ + "/step_10");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("error: --grads: layer w: file holds 40 bytes, shape 96x64 needs 24576"),
            std::string::npos)
      << r.err;
  r = Run("--grads " + dir_ + "/nowhere");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("error: --grads: cannot open"), std::string::npos) << r.err;
  r = Run("--grads-stale " + dir_ + "/step_9");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("error: --grads-stale: needs --grads"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace geofp8
