// geofp8-tool analyze with the geometry flags, end to end: band metrics in the JSON agree with
// the library on the --out file, lowrank beats Euclidean on an anisotropic gradient, a stale
// basis from --basis-from works, and bad flags give one-line errors with exit code 2.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "kernels/codec/codec.h"
#include "kernels/geometry/analysis.h"
#include "kernels/geometry/hadamard.h"
#include "kernels/geometry/synthetic.h"

namespace geofp8 {
namespace {

struct Result {
  int code;
  std::string out, err;
};

class AnalyzeToolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/geofp8_analyze_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    g_ = MakeSyntheticGradient({SyntheticFamily::kSpectral, 96, 160, 1.5, 5, 0.0});
    prev_ = MakeSyntheticGradient({SyntheticFamily::kSpectral, 96, 160, 1.5, 5, 0.1});
    Write("g.f32", g_);
    Write("prev.f32", prev_);
  }
  void TearDown() override { std::system(("rm -rf " + dir_).c_str()); }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  void Write(const std::string& name, const std::vector<float>& x) const {
    std::ofstream os(Path(name), std::ios::binary);
    os.write(reinterpret_cast<const char*>(x.data()), 4 * x.size());
  }
  static std::string Slurp(const std::string& path) {
    std::ifstream is(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(is), {}};
  }
  Result Run(const std::string& args) const {
    const std::string cmd = std::string(GEOFP8_TOOL_PATH) + " analyze " + args + " >" +
                            Path("stdout") + " 2>" + Path("stderr");
    const int status = std::system(cmd.c_str());
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, Slurp(Path("stdout")),
            Slurp(Path("stderr"))};
  }
  static double Field(const std::string& json, const std::string& key) {
    const std::string k = "\"" + key + "\": ";
    const size_t p = json.find(k);
    EXPECT_NE(p, std::string::npos) << key << " missing in " << json;
    return p == std::string::npos ? -1 : std::strtod(json.c_str() + p + k.size(), nullptr);
  }

  std::string dir_;
  std::vector<float> g_, prev_;
};

TEST_F(AnalyzeToolTest, BandMetricsMatchTheLibraryAndLowRankBeatsEuclidean) {
  const std::string common =
      "--format fp8_e4m3 --scaling tensor --in " + Path("g.f32") + " --shape 96x160";
  const Result none = Run(common + " --out " + Path("none.f32"));
  ASSERT_EQ(none.code, 0) << none.err;
  const Result low = Run(common + " --geometry lowrank --rank 8 --out " + Path("low.f32"));
  ASSERT_EQ(low.code, 0) << low.err;
  for (const std::string* json : {&none.out, &low.out}) {
    EXPECT_NE(json->find("\"band_errors\": [{\"begin\": 0, \"end\": "), std::string::npos) << *json;
    EXPECT_NE(json->find("\"residual_subspace_error\": "), std::string::npos);
    EXPECT_GE(Field(*json, "transform_seconds"), 0.0);
    EXPECT_NE(json->find("\"rel_fro_error\": "), std::string::npos) << "issue-1 metrics kept";
  }
  EXPECT_NE(low.out.find("\"geometry\": \"lowrank\", \"rank\": 8"), std::string::npos) << low.out;
  // The JSON's worst band error is the library's on the decoded file.
  const SpectralReference ref = ComputeSpectralReference(g_, 96, 160);
  for (auto [json, file] : {std::pair{&none.out, "none.f32"}, std::pair{&low.out, "low.f32"}}) {
    const std::string bytes = Slurp(Path(file));
    std::vector<float> decoded(bytes.size() / 4);
    std::memcpy(decoded.data(), bytes.data(), bytes.size());
    const double want = ComputeBandErrors(ref, g_, decoded, file == std::string("low.f32") ? 8 : 16)
                            .worst_band_error;
    EXPECT_NEAR(Field(*json, "worst_band_error"), want, 1e-6 * want) << file;
    EXPECT_NEAR(Field(*json, "rel_fro_error"), RelFroError(g_, decoded), 1e-6) << file;
  }
  // The point of the geometry: several times lower worst band error on an i^-1.5 spectrum.
  const Result none8 = Run(common + " --rank 8");
  EXPECT_GT(Field(none8.out, "worst_band_error"), 3 * Field(low.out, "worst_band_error"));
}

TEST_F(AnalyzeToolTest, StaleBasisFromAnotherGradient) {
  const Result r = Run("--format nvfp4 --in " + Path("g.f32") +
                       " --shape 96x160 --geometry lowrank "
                       "--rank 8 --alpha 0.25 --basis-from " +
                       Path("prev.f32"));
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("\"basis_from\": \"" + Path("prev.f32") + "\""), std::string::npos);
  const Result euclid = Run("--format nvfp4 --in " + Path("g.f32") + " --shape 96x160 --rank 8");
  EXPECT_LT(Field(r.out, "worst_band_error"), Field(euclid.out, "worst_band_error"));
  const Result diag = Run("--in " + Path("g.f32") + " --shape 96x160 --geometry diag");
  EXPECT_EQ(diag.code, 0) << diag.err;
}

// --geometry hadamard: the decoded file is the library's rotate, encode, decode, inverse
// rotate, bit for bit, with or without a shape, and after lowrank.
TEST_F(AnalyzeToolTest, HadamardRotationIsTheLibrarysAndComposesWithLowRank) {
  auto library = [&](int block, const CodecOptions& o) {
    std::vector<float> t = g_;
    HadamardForward(t, block, HadamardLayerSeed(o.seed, 0));
    std::vector<uint8_t> enc(EncodedBytes(o, t.size()));
    Encode(t, o, enc);
    Decode(enc, t);
    HadamardInverse(t, block, HadamardLayerSeed(o.seed, 0));
    return t;
  };
  auto read = [&](const std::string& name) {
    const std::string bytes = Slurp(Path(name));
    std::vector<float> v(bytes.size() / 4);
    std::memcpy(v.data(), bytes.data(), bytes.size());
    return v;
  };
  CodecOptions nv;
  nv.format = Format::kNvfp4;
  nv.seed = 3;
  const Result flat = Run("--format nvfp4 --seed 3 --geometry hadamard --in " + Path("g.f32") +
                          " --out " + Path("h.f32"));
  ASSERT_EQ(flat.code, 0) << flat.err;
  EXPECT_NE(flat.out.find("\"geometry\": \"hadamard\", \"hadamard_block\": 16"), std::string::npos)
      << flat.out;
  EXPECT_EQ(read("h.f32"), library(16, nv));
  EXPECT_NEAR(Field(flat.out, "rel_fro_error"), RelFroError(g_, library(16, nv)), 1e-6);
  CodecOptions fp8;
  const Result small = Run("--geometry hadamard --hadamard-block 32 --shape 96x160 --in " +
                           Path("g.f32") + " --out " + Path("s.f32"));
  ASSERT_EQ(small.code, 0) << small.err;
  EXPECT_NE(small.out.find("\"hadamard_block\": 32"), std::string::npos) << small.out;
  EXPECT_EQ(read("s.f32"), library(32, fp8));
  const Result both =
      Run("--geometry lowrank+hadamard --rank 8 --shape 96x160 --in " + Path("g.f32"));
  ASSERT_EQ(both.code, 0) << both.err;
  EXPECT_NE(both.out.find("\"geometry\": \"lowrank+hadamard\", \"rank\": 8"), std::string::npos)
      << both.out;
  const Result bad_block =
      Run("--format nvfp4 --geometry hadamard --hadamard-block 32 --in " + Path("g.f32"));
  EXPECT_EQ(bad_block.code, 2);
  EXPECT_NE(bad_block.err.find("hadamard-block: must divide the codec's scale block 16 (32)"),
            std::string::npos)
      << bad_block.err;
  const Result no_rotation = Run("--hadamard-block 64 --in " + Path("g.f32"));
  EXPECT_EQ(no_rotation.code, 2);
  EXPECT_NE(no_rotation.err.find("hadamard-block: needs --geometry hadamard"), std::string::npos)
      << no_rotation.err;
}

TEST_F(AnalyzeToolTest, BadGeometryFlagsAreOneLineUsageErrors) {
  Write("small.f32", std::vector<float>(10, 1.f));
  struct Case {
    std::string args, message;
  };
  const std::string in = " --in " + Path("g.f32");
  for (const Case& c : std::vector<Case>{
           {in + " --geometry lowrank", "geometry: needs --shape MxN"},
           {in + " --shape 96x160 --geometry wide",
            "geometry: unknown geometry (wide); accepted: none, diag, lowrank, hadamard, "
            "diag+hadamard, lowrank+hadamard"},
           {in + " --shape 15360 --geometry lowrank", "shape: expected a matrix MxN (15360)"},
           {in + " --shape 96x160 --geometry lowrank --rank 0", "rank: must be at least 1 (0)"},
           // Issue #29: --rank 600 on 512x512 silently made the geometry a no-op.
           {in + " --shape 96x160 --geometry lowrank --rank 48",
            "rank: must be below half of min(M, N) = 48 for shape 96x160 (48)"},
           {in + " --shape 96x160 --rank 600",
            "rank: must be below half of min(M, N) = 48 for shape 96x160 (600)"},
           {in + " --shape 96x160 --geometry lowrank --alpha 2", "alpha: must be in [0, 1] (2)"},
           {in + " --shape 96x160 --basis-from " + Path("prev.f32"),
            "basis-from: needs --geometry"},
           {in + " --shape 96x160 --geometry lowrank --basis-from " + Path("small.f32"),
            "basis-from: shape 96x160 has 15360 elements but the input holds 10"},
       }) {
    const Result r = Run(c.args);
    EXPECT_EQ(r.code, 2) << c.args << ": " << r.err;
    EXPECT_NE(r.err.find("geofp8-tool: error: " + c.message), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

}  // namespace
}  // namespace geofp8
