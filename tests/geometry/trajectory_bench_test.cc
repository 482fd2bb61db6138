// geofp8-bench trajectory end to end: geofp8-train dumps a short real trajectory (--dump-steps with
// a range), the bench replays it through every rank's Exchanger and prints the per-layer table;
// missing steps, mismatched shapes and NaN values are one-line usage errors naming the file.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace geofp8 {
namespace {

namespace fs = std::filesystem;

struct Result {
  int code;
  std::string out, err;
};

std::string Slurp(const fs::path& path) {
  std::ifstream is(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(is), {}};
}

class TrajectoryBenchTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new fs::path(fs::temp_directory_path() /
                        ("geofp8_trajectory_test_" + std::to_string(::getpid())));
    fs::create_directories(*dir_);
    std::ofstream(*dir_ / "ema.yaml")
        << "geometry_refresh: {interval: 1, estimator: ema, beta: 0.8}\n"
           "policy:\n  layers:\n    - {match: '*', geometry: lowrank, rank: 4}\n";
    std::ofstream(*dir_ / "hadamard.yaml")
        << "policy:\n  default: {format: nvfp4, geometry: hadamard}\n";
    // Two ranks of llama-tiny on the Markov source: steps 0-5 of every rank are dumped.
    const std::string cmd = std::string(GEOFP8_TRAIN_PATH) +
                            " --preset llama-tiny --ranks 2 --steps 6 --policy fp32 --quiet "
                            "--data markov:3 --dump-grads '" +
                            (*dir_ / "dump").string() + "' --dump-steps 0,1-5 >/dev/null 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }
  static void TearDownTestSuite() {
    fs::remove_all(*dir_);
    delete dir_;
  }

  static Result Run(const std::string& args) {
    const std::string cmd = std::string(GEOFP8_BENCH_PATH) + " trajectory " + args + " >'" +
                            (*dir_ / "stdout").string() + "' 2>'" + (*dir_ / "stderr").string() +
                            "'";
    const int status = std::system(cmd.c_str());
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, Slurp(*dir_ / "stdout"),
            Slurp(*dir_ / "stderr")};
  }
  static fs::path Dump() { return *dir_ / "dump"; }
  static fs::path Copy(const std::string& name) {
    const fs::path to = *dir_ / name;
    fs::remove_all(to);
    fs::copy(Dump(), to, fs::copy_options::recursive);
    return to;
  }

  static fs::path* dir_;
};

fs::path* TrajectoryBenchTest::dir_ = nullptr;

TEST_F(TrajectoryBenchTest, ReplaysEveryRankAndTablesEachMatrixAgainstEuclidean) {
  for (int s = 0; s <= 5; ++s) {
    ASSERT_TRUE(fs::exists(Dump() / ("step_" + std::to_string(s)) / "shapes.json")) << s;
  }
  const Result r =
      Run("'" + Dump().string() + "' --steps 0-5 --warmup 2 --band-k 4 --policy '" +
          (*dir_ / "ema.yaml").string() + "' --csv '" + (*dir_ / "out.csv").string() + "'");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("steps 0-5 (2 warm-up), 2 ranks, band k = 4"), std::string::npos) << r.out;
  // Every 2-D parameter gets a row (llama-tiny: embedding, 2 x (4 attention + 3 MLP), lm_head);
  // no norm gain does.
  size_t rows = 0;
  std::istringstream out(r.out);
  for (std::string line; std::getline(out, line);) {
    if (!line.starts_with("| ") || line.starts_with("| layer |")) continue;
    EXPECT_EQ(line.find("norm"), std::string::npos) << line;
    ++rows;
    // The last three cells: the summed error's ratio and both coherences, which lie in
    // [0, steps] (||sum of 4 errors||^2 <= 4 sum ||e||^2 by Cauchy-Schwarz).
    std::vector<std::string> cells;
    std::stringstream ls(line);
    for (std::string c; std::getline(ls, c, '|');) cells.push_back(c);
    ASSERT_EQ(cells.size(), 13u) << line;  // a leading empty cell, then 12
    const double summed = std::stod(cells[10]), ce = std::stod(cells[11]),
                 cd = std::stod(cells[12]);
    EXPECT_TRUE(summed > 0 && summed < 2) << line;
    EXPECT_TRUE(ce > 0 && ce <= 4.005 && cd > 0 && cd <= 4.005) << line;
  }
  EXPECT_EQ(rows, 16u) << r.out;
  EXPECT_NE(r.out.find("over 16 layers, deployed rel_fro"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("Summed over the 4 measured steps"), std::string::npos) << r.out;
  // The CSV holds every (variant, layer, measured step) with finite errors.
  std::istringstream csv(Slurp(*dir_ / "out.csv"));
  std::string line;
  std::getline(csv, line);
  EXPECT_EQ(line, "policy,variant,layer,step,rel_fro_error,worst_band_error,residual_error");
  int lines = 0;
  while (std::getline(csv, line)) {
    ++lines;
    std::vector<std::string> f;
    std::stringstream ls(line);
    for (std::string x; std::getline(ls, x, ',');) f.push_back(x);
    ASSERT_EQ(f.size(), 7u) << line;
    const double rel = std::stod(f[4]);
    EXPECT_TRUE(std::isfinite(rel) && rel > 0 && rel < 1) << line;
    EXPECT_GE(std::stoi(f[3]), 2) << line;  // warm-up steps are not measured
  }
  EXPECT_EQ(lines, 3 * 16 * 4);  // deployed, euclid, fresh x 16 matrices x steps 2-5
}

// A rotation without a geometry is judged too, against the same format without the rotation;
// it has no basis, so its fresh bound is the deployed exchange itself and its residual none.
TEST_F(TrajectoryBenchTest, ARotationAloneIsJudgedAgainstTheUnrotatedTwin) {
  const Result r = Run("'" + Dump().string() + "' --steps 0-5 --warmup 2 --policy '" +
                       (*dir_ / "hadamard.yaml").string() + "'");
  ASSERT_EQ(r.code, 0) << r.err;
  const size_t at = r.out.find("over 16 layers, deployed rel_fro ");
  ASSERT_NE(at, std::string::npos) << r.out;
  double rel = 0, worst = 0, fresh_rel = 0, fresh_worst = 0;
  ASSERT_EQ(std::sscanf(r.out.c_str() + at,
                        "over 16 layers, deployed rel_fro %lf and worst band %lf of Euclidean "
                        "(geometric mean over layers); fresh bound %lf and %lf;",
                        &rel, &worst, &fresh_rel, &fresh_worst),
            4)
      << r.out;
  // The rotated exchange's error is not the unrotated one's, and the bound is the same exchange.
  EXPECT_TRUE(rel > 0 && rel < 2 && std::abs(rel - 1) > 1e-3) << r.out;
  EXPECT_TRUE(worst > 0 && worst < 4) << r.out;
  EXPECT_DOUBLE_EQ(fresh_rel, rel) << r.out;
  EXPECT_NE(r.out.find("residual-subspace nan"), std::string::npos) << r.out;
}

TEST_F(TrajectoryBenchTest, BadTrajectoriesAreOneLineUsageErrorsNamingTheFile) {
  const std::string ema = " --policy '" + (*dir_ / "ema.yaml").string() + "'";
  Result r = Run("'" + Dump().string() + "' --steps 0-7" + ema);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("error: DIR: step 6 is missing from the trajectory ("), std::string::npos)
      << r.err;
  EXPECT_NE(r.err.find("step_6)"), std::string::npos) << r.err;

  const fs::path nan = Copy("nan");
  {
    std::fstream f(nan / "step_3" / "lm_head.rank1.f32",
                   std::ios::in | std::ios::out | std::ios::binary);
    const float bad = NAN;
    f.seekp(40);
    f.write(reinterpret_cast<const char*>(&bad), 4);
  }
  r = Run("'" + nan.string() + "' --steps 0-5" + ema);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("error: DIR: layer lm_head: holds a non-finite value (" +
                       (nan / "step_3" / "lm_head.rank1.f32").string() + ")"),
            std::string::npos)
      << r.err;

  const fs::path shape = Copy("shape");
  {
    std::string json = Slurp(shape / "step_4" / "shapes.json");
    const size_t at = json.find("\"rows\": 64");
    ASSERT_NE(at, std::string::npos) << json;
    json.replace(at, 10, "\"rows\": 32");
    std::ofstream(shape / "step_4" / "shapes.json") << json;
  }
  r = Run("'" + shape.string() + "' --steps 0-5" + ema);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("error: DIR: layers or shapes differ from step 0 (" +
                       (shape / "step_4" / "shapes.json").string() + ")"),
            std::string::npos)
      << r.err;

  r = Run("'" + Dump().string() + "' --steps 0-5 --warmup 6" + ema);
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("error: --warmup: leaves no step to measure in 0-5 (6)"), std::string::npos)
      << r.err;
  r = Run("'" + Dump().string() + "' --steps 0-5 --policy fp8");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("error: --policy: uses no geometry: nothing to judge (fp8)"),
            std::string::npos)
      << r.err;
}

}  // namespace
}  // namespace geofp8
