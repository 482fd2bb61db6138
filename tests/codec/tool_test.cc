// geofp8-tool end to end: raw encodes compared byte by byte with the CUDA toolkit oracle,
// wire round trips, analyze's JSON, and one-line errors with the documented exit codes.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "kernels/codec/codec.h"
#include "kernels/codec/element.h"
#include "tests/codec/oracle_sweep.h"

namespace geofp8 {
namespace {

struct Result {
  int code;
  std::string out, err;
};

class ToolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/geofp8_tool_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::system(("rm -rf " + dir_).c_str()); }

  std::string Path(const std::string& name) const { return dir_ + "/" + name; }

  Result Run(const std::string& args) const {
    const std::string cmd =
        std::string(GEOFP8_TOOL_PATH) + " " + args + " >" + Path("stdout") + " 2>" + Path("stderr");
    const int status = std::system(cmd.c_str());
    Result r{WIFEXITED(status) ? WEXITSTATUS(status) : -1, Slurp(Path("stdout")),
             Slurp(Path("stderr"))};
    return r;
  }

  static std::string Slurp(const std::string& path) {
    std::ifstream is(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(is), {}};
  }
  void WriteFloats(const std::string& name, const std::vector<float>& x) const {
    std::ofstream os(Path(name), std::ios::binary);
    os.write(reinterpret_cast<const char*>(x.data()), 4 * x.size());
  }
  std::vector<float> ReadFloats(const std::string& name) const {
    const std::string s = Slurp(Path(name));
    std::vector<float> x(s.size() / 4);
    std::memcpy(x.data(), s.data(), 4 * x.size());
    return x;
  }

  std::string dir_;
};

// Finite special values plus random values over a wide exponent range.
std::vector<float> TestValues() {
  std::vector<float> x = {0.f,  -0.f,  1.f,        -1.f,    448.f, 464.f,           465.f,
                          1e6f, -1e6f, 57344.f,    61440.f, 1e-3f, 1e-7f,           6.f,
                          5.f,  0.25f, 0.2500001f, 0.75f,   3e38f, 1.17549435e-38f, 1e-45f,
                          2.5f, 3.5f,  -5.5f};
  std::mt19937 rng(11);
  std::uniform_int_distribution<uint32_t> bits;
  while (x.size() < 4001) {
    const float f = element::BitsFloat(bits(rng));
    if (std::isfinite(f)) x.push_back(f);
  }
  return x;
}

#if GEOFP8_HAVE_CUDA_FP8_HEADERS
TEST_F(ToolTest, RawEncodeMatchesOracleByteForByte) {
  const auto x = TestValues();
  WriteFloats("x.f32", x);
  for (const std::string fmt : {"fp8_e4m3", "fp8_e5m2", "nvfp4"}) {
    const Result r = Run("encode --format " + fmt + " --scaling none --raw --in " + Path("x.f32") +
                         " --out " + Path("x.raw"));
    ASSERT_EQ(r.code, 0) << r.err;
    const std::string raw = Slurp(Path("x.raw"));
    if (fmt == "nvfp4") {
      ASSERT_EQ(raw.size(), (x.size() + 1) / 2);
      for (size_t i = 0; i < x.size(); ++i) {
        const uint8_t nib = (static_cast<uint8_t>(raw[i / 2]) >> (4 * (i & 1))) & 0xF;
        ASSERT_EQ(nib, element::OracleE2M1(x[i])) << i << " x=" << x[i];
      }
      EXPECT_EQ(static_cast<uint8_t>(raw.back()) >> 4, 0);  // odd count: unused high nibble
    } else {
      ASSERT_EQ(raw.size(), x.size());
      for (size_t i = 0; i < x.size(); ++i) {
        const uint8_t want =
            fmt == "fp8_e4m3" ? element::OracleE4M3(x[i]) : element::OracleE5M2(x[i]);
        ASSERT_EQ(static_cast<uint8_t>(raw[i]), want) << fmt << " " << i << " x=" << x[i];
      }
    }
    // And back: decode --raw gives each code's value, as the toolkit's fp8/fp4 -> float
    // conversion reads it (all codes here are finite: SATFINITE encoding of finite inputs).
    ASSERT_EQ(Run("decode --raw --format " + fmt + " --shape " + std::to_string(x.size()) +
                  " --in " + Path("x.raw") + " --out " + Path("x.dec"))
                  .code,
              0);
    const std::vector<float> dec = ReadFloats("x.dec");
    ASSERT_EQ(dec.size(), x.size());
    for (size_t i = 0; i < x.size(); ++i) {
      float want;
      if (fmt == "nvfp4") {
        __nv_fp4_e2m1 e;
        e.__x = static_cast<__nv_fp4_storage_t>(
            (static_cast<uint8_t>(raw[i / 2]) >> (4 * (i & 1))) & 0xF);
        want = static_cast<float>(e);
      } else if (fmt == "fp8_e4m3") {
        __nv_fp8_e4m3 e;
        e.__x = static_cast<__nv_fp8_storage_t>(raw[i]);
        want = static_cast<float>(e);
      } else {
        __nv_fp8_e5m2 e;
        e.__x = static_cast<__nv_fp8_storage_t>(raw[i]);
        want = static_cast<float>(e);
      }
      ASSERT_EQ(element::FloatBits(dec[i]), element::FloatBits(want))
          << fmt << " " << i << " x=" << x[i] << " decoded " << dec[i] << " want " << want;
    }
  }
}
#endif

TEST_F(ToolTest, EncodeDecodeMatchesTheLibrary) {
  const auto x = TestValues();
  std::vector<float> small(x.begin(), x.begin() + 300);
  for (float& v : small) v = std::fmod(v, 1000.f);
  WriteFloats("x.f32", small);
  for (const std::string fmt : {"fp32", "bf16", "fp8_e4m3", "fp8_e5m2", "mxfp8", "nvfp4"}) {
    const std::string block = fmt == "mxfp8" ? "32" : "16";
    const Result r =
        Run("encode --format " + fmt + " --scaling block --block " + block +
            " --rounding stochastic --seed 5 --in " + Path("x.f32") + " --out " + Path("x.enc"));
    ASSERT_EQ(r.code, 0) << fmt << r.err;
    CodecOptions o;
    o.format = *ParseFormat(fmt);
    o.block = 16;
    o.rounding = Rounding::kStochastic;
    o.seed = 5;
    std::vector<uint8_t> want(EncodedBytes(o, small.size()));
    Encode(small, o, want);
    const std::string got = Slurp(Path("x.enc"));
    ASSERT_EQ(got, std::string(want.begin(), want.end())) << fmt;
    ASSERT_EQ(Run("decode --in " + Path("x.enc") + " --out " + Path("x.dec")).code, 0);
    std::vector<float> y(small.size());
    Decode(want, y);
    EXPECT_EQ(ReadFloats("x.dec"), y) << fmt;
  }
}

TEST_F(ToolTest, AnalyzePrintsJsonAndWritesDecoded) {
  std::vector<float> x(1000);
  std::mt19937 rng(3);
  std::normal_distribution<float> d;
  for (auto& v : x) v = d(rng);
  WriteFloats("x.f32", x);
  const Result r =
      Run("analyze --format fp8_e4m3 --in " + Path("x.f32") + " --out " + Path("y.f32"));
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* key :
       {"\"rel_fro_error\"", "\"cosine\"", "\"max_abs_error\"", "\"underflow_fraction\"",
        "\"saturation_fraction\"", "\"nonfinite_count\": 0", "\"payload_bytes\": 1000",
        "\"scale_bytes\": 32", "\"compression_ratio\": 3.87596899"}) {
    EXPECT_NE(r.out.find(key), std::string::npos) << key << " in " << r.out;
  }
  // --out holds the decoded values of analyze's encode (its defaults: fp8_e4m3, block 128,
  // nearest), bit for bit, and each is within one E4M3 half-step of x.
  CodecOptions o;
  o.format = Format::kFp8E4M3;
  o.scaling = Scaling::kBlock;
  o.block = 128;
  std::vector<uint8_t> enc(EncodedBytes(o, x.size()));
  Encode(x, o, enc);
  std::vector<float> want(x.size());
  Decode(enc, want);
  const std::vector<float> y = ReadFloats("y.f32");
  ASSERT_EQ(y.size(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    ASSERT_EQ(element::FloatBits(y[i]), element::FloatBits(want[i])) << i;
    // E4M3 half-step: 2^-4 relative for normals, 2^-10 / scale below (scale = 448 / amax).
    float amax = 0.f;
    for (size_t j = i / 128 * 128; j < std::min(x.size(), i / 128 * 128 + 128); ++j)
      amax = std::max(amax, std::fabs(x[j]));
    EXPECT_LE(std::fabs(y[i] - x[i]), std::fabs(x[i]) / 16 + std::ldexp(amax / 448.0, -10)) << i;
  }
  const Result n = Run("analyze --format nvfp4 --in " + Path("x.f32"));
  EXPECT_NE(n.out.find("\"block\": 16"), std::string::npos) << n.out;
}

TEST_F(ToolTest, BadInputGetsOneLineErrorAndExitCode) {
  WriteFloats("x.f32", {1.f, 2.f, 3.f});
  {
    std::ofstream os(Path("odd.f32"), std::ios::binary);
    os << "abcdefg";
  }
  struct Case {
    std::string args;
    int code;
    std::string needle;
  };
  const Case cases[] = {
      {"analyze --in " + Path("missing.f32"), 1, "in: cannot open"},
      {"analyze --in " + Path("odd.f32"), 1, "not a multiple of 4"},
      {"analyze --format fp7 --in " + Path("x.f32"), 2, "format: unknown format (fp7)"},
      {"analyze --scaling row --in " + Path("x.f32"), 2, "scaling: unknown scaling (row)"},
      {"analyze --rounding up --in " + Path("x.f32"), 2, "rounding: unknown rounding (up)"},
      {"analyze --block 0 --in " + Path("x.f32"), 2, "block: must be at least 1 (0)"},
      {"analyze --format mxfp8 --block 64 --in " + Path("x.f32"), 2, "block: mxfp8"},
      {"encode --shape 2x2 --in " + Path("x.f32") + " --out " + Path("o"), 2, "shape:"},
      {"encode --raw --in " + Path("x.f32") + " --out " + Path("o"), 2, "raw: needs --scaling"},
      {"decode --in " + Path("x.f32") + " --out " + Path("o"), 1, "in: encoded buffer"},
      {"analyze", 2, "--in"},
      {"frobnicate", 2, "error"},
  };
  for (const Case& c : cases) {
    const Result r = Run(c.args);
    EXPECT_EQ(r.code, c.code) << c.args << ": " << r.err;
    EXPECT_NE(r.err.find("geofp8-tool: error: "), std::string::npos) << r.err;
    EXPECT_NE(r.err.find(c.needle), std::string::npos) << c.args << ": " << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

}  // namespace
}  // namespace geofp8
