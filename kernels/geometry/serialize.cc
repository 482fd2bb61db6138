// Wire form of a Geometry for the owner's broadcast: little-endian, versioned, checksummed.
// Layout: "GEOM" | u8 format version | u8 mode | u16 flags | u64 version | i64 m | i64 n | i32 k |
// f32 alpha | f32 delta_L | f32 delta_R | arrays (lowrank: U, V, sigma[, sigma_right]; diag: row,
// col) | u32 FNV-1a. Version 2 adds flags bit 0: sigma_right follows sigma. Version 1 (flags 0) is
// still read, so checkpoints written before it resume.
#include <bit>
#include <cmath>
#include <cstring>

#include "kernels/common/check.h"
#include "kernels/geometry/factor_sketch.h"
#include "kernels/geometry/geometry.h"

namespace geofp8 {
namespace {

static_assert(std::endian::native == std::endian::little, "wire form assumes a little-endian host");

constexpr char kMagic[4] = {'G', 'E', 'O', 'M'};
constexpr uint8_t kFormatVersion = 2;
constexpr uint16_t kHasSigmaRight = 1;
constexpr size_t kHeaderBytes = 4 + 1 + 1 + 2 + 8 + 8 + 8 + 4 + 4 + 4 + 4;
constexpr int64_t kMaxDim = int64_t{1} << 32;

uint32_t Fnv1a(const uint8_t* p, size_t n) {
  uint32_t h = 2166136261u;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 16777619u;
  return h;
}

template <typename T>
void Put(std::vector<uint8_t>& out, const T& v) {
  const auto* p = reinterpret_cast<const uint8_t*>(&v);
  out.insert(out.end(), p, p + sizeof(T));
}
void PutFloats(std::vector<uint8_t>& out, const std::vector<float>& v);

template <typename T>
void PutArray(std::vector<uint8_t>& out, const std::vector<T>& v) {
  const auto* p = reinterpret_cast<const uint8_t*>(v.data());
  out.insert(out.end(), p, p + v.size() * sizeof(T));
}

void PutFloats(std::vector<uint8_t>& out, const std::vector<float>& v) { PutArray(out, v); }

struct Reader {
  std::span<const uint8_t> in;
  size_t pos = 0;
  const char* what = "DeserializeGeometry";
  template <typename T>
  T Get(const char* field) {
    if (in.size() - pos < sizeof(T)) GEOFP8_FAIL(what, ": truncated at field ", field);
    T v;
    std::memcpy(&v, in.data() + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  template <typename T = float>
  std::vector<T> Array(int64_t count, const char* field) {
    const size_t bytes = static_cast<size_t>(count) * sizeof(T);
    if (count < 0 || in.size() - pos < bytes) GEOFP8_FAIL(what, ": truncated in array ", field);
    std::vector<T> v(static_cast<size_t>(count));
    std::memcpy(v.data(), in.data() + pos, bytes);
    pos += bytes;
    for (T x : v) {
      if (!std::isfinite(x)) GEOFP8_FAIL(what, ": ", field, " holds a non-finite value (", x, ")");
    }
    return v;
  }
  std::vector<float> Floats(int64_t count, const char* field) { return Array<float>(count, field); }
};

// The payload of a checksummed wire form: at least `header` bytes after a 4-byte magic, and an
// FNV-1a of everything before the trailing 4 bytes. Returns a reader past the magic.
Reader OpenChecked(std::span<const uint8_t> bytes, const char (&magic)[4], size_t header,
                   const char* what) {
  if (bytes.size() < header + 4) {
    GEOFP8_FAIL(what, ": ", bytes.size(), " bytes is shorter than the header");
  }
  if (std::memcmp(bytes.data(), magic, 4) != 0) GEOFP8_FAIL(what, ": bad magic");
  uint32_t stored = 0;
  std::memcpy(&stored, bytes.data() + bytes.size() - 4, 4);
  const uint32_t actual = Fnv1a(bytes.data(), bytes.size() - 4);
  if (stored != actual) {
    GEOFP8_FAIL(what, ": checksum mismatch (stored ", stored, ", computed ", actual, ")");
  }
  return Reader{bytes.first(bytes.size() - 4), 4, what};
}

size_t ArrayFloats(const Geometry& g) {
  switch (g.mode) {
    case GeometryMode::kLowRank:
      return static_cast<size_t>((g.m + g.n + 1) * g.k) + g.sigma_right.size();
    case GeometryMode::kDiag:
      return static_cast<size_t>(g.m + g.n);
    default:
      return 0;
  }
}

}  // namespace

namespace {

// The wire form without its trailing checksum, appended to `out`.
void AppendGeometryBody(const Geometry& g, std::vector<uint8_t>& out) {
  GEOFP8_CHECK(g.m >= 0 && g.n >= 0 && g.m < kMaxDim && g.n < kMaxDim, "geometry shape ", g.m, "x",
               g.n);
  if (g.mode == GeometryMode::kLowRank) {
    GEOFP8_CHECK(g.k >= 0 && g.U.size() == size_t(g.m * g.k) && g.V.size() == size_t(g.n * g.k) &&
                     g.sigma.size() == size_t(g.k) &&
                     (g.sigma_right.empty() || g.sigma_right.size() == size_t(g.k)),
                 "lowrank geometry arrays do not match m=", g.m, " n=", g.n, " k=", g.k);
  } else if (g.mode == GeometryMode::kDiag) {
    GEOFP8_CHECK(g.row_scale.size() == size_t(g.m) && g.col_scale.size() == size_t(g.n),
                 "diag geometry scale sizes ", g.row_scale.size(), ", ", g.col_scale.size());
  }
  out.reserve(out.size() + kHeaderBytes + ArrayFloats(g) * sizeof(float));
  for (char c : kMagic) out.push_back(static_cast<uint8_t>(c));
  Put<uint8_t>(out, kFormatVersion);
  Put<uint8_t>(out, static_cast<uint8_t>(g.mode));
  const bool right = g.mode == GeometryMode::kLowRank && !g.sigma_right.empty();
  Put<uint16_t>(out, right ? kHasSigmaRight : 0);
  Put<uint64_t>(out, g.version);
  Put<int64_t>(out, g.m);
  Put<int64_t>(out, g.n);
  Put<int32_t>(out, g.mode == GeometryMode::kLowRank ? g.k : 0);
  Put<float>(out, g.alpha);
  Put<float>(out, g.delta_L);
  Put<float>(out, g.delta_R);
  if (g.mode == GeometryMode::kLowRank) {
    PutFloats(out, g.U);
    PutFloats(out, g.V);
    PutFloats(out, g.sigma);
    if (right) PutFloats(out, g.sigma_right);
  } else if (g.mode == GeometryMode::kDiag) {
    PutFloats(out, g.row_scale);
    PutFloats(out, g.col_scale);
  }
}

}  // namespace

std::vector<uint8_t> SerializeGeometry(const Geometry& g) {
  std::vector<uint8_t> out;
  AppendGeometryBody(g, out);
  Put<uint32_t>(out, Fnv1a(out.data(), out.size()));
  return out;
}

Geometry DeserializeGeometry(std::span<const uint8_t> bytes) {
  Reader r = OpenChecked(bytes, kMagic, kHeaderBytes, "DeserializeGeometry");
  const auto fv = r.Get<uint8_t>("format_version");
  if (fv != 1 && fv != kFormatVersion) {
    GEOFP8_FAIL("DeserializeGeometry: format_version ", int(fv), " unsupported (reads 1 and ",
                int(kFormatVersion), ")");
  }
  const auto mode = r.Get<uint8_t>("mode");
  if (mode > static_cast<uint8_t>(GeometryMode::kLowRank)) {
    GEOFP8_FAIL("DeserializeGeometry: mode: unknown value (", int(mode),
                "); accepted: ", AcceptedGeometryModes());
  }
  const auto flags = r.Get<uint16_t>("flags");
  if (flags & ~kHasSigmaRight || (fv == 1 && flags != 0)) {
    GEOFP8_FAIL("DeserializeGeometry: flags: unknown bits (", flags, ")");
  }
  Geometry g;
  g.mode = static_cast<GeometryMode>(mode);
  g.version = r.Get<uint64_t>("version");
  g.m = r.Get<int64_t>("m");
  g.n = r.Get<int64_t>("n");
  g.k = r.Get<int32_t>("k");
  g.alpha = r.Get<float>("alpha");
  g.delta_L = r.Get<float>("delta_L");
  g.delta_R = r.Get<float>("delta_R");
  if (g.m < 0 || g.n < 0 || g.m >= kMaxDim || g.n >= kMaxDim) {
    GEOFP8_FAIL("DeserializeGeometry: shape out of range (", g.m, "x", g.n, ")");
  }
  if (g.k < 0 || g.k > std::min(g.m, g.n)) {
    GEOFP8_FAIL("DeserializeGeometry: k out of range for ", g.m, "x", g.n, " (", g.k, ")");
  }
  if (!std::isfinite(g.alpha) || g.alpha < 0 || !(g.delta_L >= 0) || !(g.delta_R >= 0) ||
      !std::isfinite(g.delta_L) || !std::isfinite(g.delta_R)) {
    GEOFP8_FAIL("DeserializeGeometry: alpha/delta out of range (", g.alpha, ", ", g.delta_L, ", ",
                g.delta_R, ")");
  }
  const bool right = (flags & kHasSigmaRight) != 0;
  if (right && g.mode != GeometryMode::kLowRank) {
    GEOFP8_FAIL("DeserializeGeometry: flags: sigma_right on a ", GeometryModeName(g.mode),
                " geometry");
  }
  if (right) g.sigma_right.resize(static_cast<size_t>(g.k));  // sized for ArrayFloats
  if (r.in.size() - r.pos != ArrayFloats(g) * sizeof(float)) {
    GEOFP8_FAIL("DeserializeGeometry: payload is ", r.in.size() - r.pos, " bytes, expected ",
                ArrayFloats(g) * sizeof(float));
  }
  if (g.mode == GeometryMode::kLowRank) {
    g.U = r.Floats(g.m * g.k, "U");
    g.V = r.Floats(g.n * g.k, "V");
    g.sigma = r.Floats(g.k, "sigma");
    if (right) g.sigma_right = r.Floats(g.k, "sigma_right");
  } else if (g.mode == GeometryMode::kDiag) {
    g.row_scale = r.Floats(g.m, "row_scale");
    g.col_scale = r.Floats(g.n, "col_scale");
    for (float x : g.row_scale)
      if (!(x > 0)) GEOFP8_FAIL("DeserializeGeometry: row_scale must be positive (", x, ")");
    for (float x : g.col_scale)
      if (!(x > 0)) GEOFP8_FAIL("DeserializeGeometry: col_scale must be positive (", x, ")");
  }
  return g;
}

// Factor sketch: "FSKT" | u8 version 1 | u8 0 | u16 0 | i64 m | i64 n | i32 width | i32 fit_k |
// u64 updates | f64 energy | f64 fit | left (m x width f32) | left_energy (f64) | right |
// right_energy | u32 FNV-1a.
namespace {
constexpr char kSketchMagic[4] = {'F', 'S', 'K', 'T'};
constexpr size_t kSketchHeaderBytes = 4 + 1 + 1 + 2 + 8 + 8 + 4 + 4 + 8 + 8 + 8;
}  // namespace

std::vector<uint8_t> SerializeFactorSketch(const FactorSketch& s) {
  GEOFP8_CHECK(
      s.m >= 0 && s.n >= 0 && s.m < kMaxDim && s.n < kMaxDim && s.width >= 0 &&
          s.left.size() == size_t(s.m * s.width) && s.right.size() == size_t(s.n * s.width) &&
          s.left_energy.size() == size_t(s.width) && s.right_energy.size() == size_t(s.width),
      "factor sketch arrays do not match m=", s.m, " n=", s.n, " width=", s.width);
  std::vector<uint8_t> out;
  for (char c : kSketchMagic) out.push_back(static_cast<uint8_t>(c));
  Put<uint8_t>(out, 1);
  Put<uint8_t>(out, 0);
  Put<uint16_t>(out, 0);
  Put<int64_t>(out, s.m);
  Put<int64_t>(out, s.n);
  Put<int32_t>(out, s.width);
  Put<int32_t>(out, s.fit_k);
  Put<uint64_t>(out, s.updates);
  Put<double>(out, s.energy);
  Put<double>(out, s.fit);
  PutArray(out, s.left);
  PutArray(out, s.left_energy);
  PutArray(out, s.right);
  PutArray(out, s.right_energy);
  Put<uint32_t>(out, Fnv1a(out.data(), out.size()));
  return out;
}

FactorSketch DeserializeFactorSketch(std::span<const uint8_t> bytes) {
  const char* what = "DeserializeFactorSketch";
  Reader r = OpenChecked(bytes, kSketchMagic, kSketchHeaderBytes, what);
  if (const auto v = r.Get<uint8_t>("format_version"); v != 1) {
    GEOFP8_FAIL(what, ": format_version ", int(v), " unsupported");
  }
  r.Get<uint8_t>("reserved");
  r.Get<uint16_t>("reserved");
  FactorSketch s;
  s.m = r.Get<int64_t>("m");
  s.n = r.Get<int64_t>("n");
  s.width = r.Get<int32_t>("width");
  s.fit_k = r.Get<int32_t>("fit_k");
  s.updates = r.Get<uint64_t>("updates");
  s.energy = r.Get<double>("energy");
  s.fit = r.Get<double>("fit");
  if (s.m < 0 || s.n < 0 || s.m >= kMaxDim || s.n >= kMaxDim || s.width < 0 ||
      s.width > std::min(s.m, s.n) || s.fit_k < 0 || s.fit_k > s.width) {
    GEOFP8_FAIL(what, ": shape out of range (", s.m, "x", s.n, ", width ", s.width, ", fit_k ",
                s.fit_k, ")");
  }
  if (!std::isfinite(s.energy) || s.energy < 0 || !std::isfinite(s.fit) || s.fit < 0) {
    GEOFP8_FAIL(what, ": energy/fit out of range (", s.energy, ", ", s.fit, ")");
  }
  const size_t expect = size_t(s.m + s.n) * s.width * sizeof(float) + 2 * size_t(s.width) * 8;
  if (r.in.size() - r.pos != expect) {
    GEOFP8_FAIL(what, ": payload is ", r.in.size() - r.pos, " bytes, expected ", expect);
  }
  s.left = r.Array<float>(s.m * s.width, "left");
  s.left_energy = r.Array<double>(s.width, "left_energy");
  s.right = r.Array<float>(s.n * s.width, "right");
  s.right_energy = r.Array<double>(s.width, "right_energy");
  return s;
}

uint64_t GeometryDigest(const Geometry& g) {
  // FNV-1a's xor-then-multiply over 8-byte words instead of bytes (eight times fewer dependent
  // multiplies: the exchanger digests every layer's new geometry at each activation, every step
  // under the ema estimator). Each step maps the state bijectively (xor with the word, then an
  // odd multiplier mod 2^64), so two inputs of the same length that differ in one word always
  // give different digests. A finalizer then mixes the high bits into the low ones. The wire form
  // without its byte-wise checksum, in a buffer kept per thread.
  thread_local std::vector<uint8_t> bytes;
  bytes.clear();
  AppendGeometryBody(g, bytes);
  uint64_t h = 14695981039346656037ull ^ bytes.size();
  size_t i = 0;
  for (; i + sizeof(uint64_t) <= bytes.size(); i += sizeof(uint64_t)) {
    uint64_t word;
    std::memcpy(&word, bytes.data() + i, sizeof word);
    h = (h ^ word) * 0x9e3779b97f4a7c15ull;
  }
  uint64_t tail = 0;
  std::memcpy(&tail, bytes.data() + i, bytes.size() - i);
  h = (h ^ tail) * 0x9e3779b97f4a7c15ull;
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  h ^= h >> 29;
  return h;
}

}  // namespace geofp8
