// Wire form of a Geometry for the owner's broadcast: little-endian, versioned, checksummed.
// Layout v1: "GEOM" | u8 format version | u8 mode | u16 0 | u64 version | i64 m | i64 n | i32 k |
// f32 alpha | f32 delta_L | f32 delta_R | arrays (lowrank: U, V, sigma; diag: row, col) | u32 FNV-1a.
#include <bit>
#include <cmath>
#include <cstring>

#include "kernels/common/check.h"
#include "kernels/geometry/geometry.h"

namespace geofp8 {
namespace {

static_assert(std::endian::native == std::endian::little, "wire form assumes a little-endian host");

constexpr char kMagic[4] = {'G', 'E', 'O', 'M'};
constexpr uint8_t kFormatVersion = 1;
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
void PutFloats(std::vector<uint8_t>& out, const std::vector<float>& v) {
  const auto* p = reinterpret_cast<const uint8_t*>(v.data());
  out.insert(out.end(), p, p + v.size() * sizeof(float));
}

struct Reader {
  std::span<const uint8_t> in;
  size_t pos = 0;
  template <typename T>
  T Get(const char* field) {
    if (in.size() - pos < sizeof(T)) GEOFP8_FAIL("DeserializeGeometry: truncated at field ", field);
    T v;
    std::memcpy(&v, in.data() + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  std::vector<float> Floats(int64_t count, const char* field) {
    const size_t bytes = static_cast<size_t>(count) * sizeof(float);
    if (in.size() - pos < bytes) GEOFP8_FAIL("DeserializeGeometry: truncated in array ", field);
    std::vector<float> v(static_cast<size_t>(count));
    std::memcpy(v.data(), in.data() + pos, bytes);
    pos += bytes;
    for (float x : v) {
      if (!std::isfinite(x)) GEOFP8_FAIL("DeserializeGeometry: ", field, " holds a non-finite value (", x, ")");
    }
    return v;
  }
};

size_t ArrayFloats(const Geometry& g) {
  switch (g.mode) {
    case GeometryMode::kLowRank: return static_cast<size_t>((g.m + g.n + 1) * g.k);
    case GeometryMode::kDiag: return static_cast<size_t>(g.m + g.n);
    default: return 0;
  }
}

}  // namespace

std::vector<uint8_t> SerializeGeometry(const Geometry& g) {
  GEOFP8_CHECK(g.m >= 0 && g.n >= 0 && g.m < kMaxDim && g.n < kMaxDim, "geometry shape ", g.m, "x", g.n);
  if (g.mode == GeometryMode::kLowRank) {
    GEOFP8_CHECK(g.k >= 0 && g.U.size() == size_t(g.m * g.k) && g.V.size() == size_t(g.n * g.k) &&
                     g.sigma.size() == size_t(g.k),
                 "lowrank geometry arrays do not match m=", g.m, " n=", g.n, " k=", g.k);
  } else if (g.mode == GeometryMode::kDiag) {
    GEOFP8_CHECK(g.row_scale.size() == size_t(g.m) && g.col_scale.size() == size_t(g.n),
                 "diag geometry scale sizes ", g.row_scale.size(), ", ", g.col_scale.size());
  }
  std::vector<uint8_t> out;
  out.reserve(kHeaderBytes + ArrayFloats(g) * sizeof(float));
  for (char c : kMagic) out.push_back(static_cast<uint8_t>(c));
  Put<uint8_t>(out, kFormatVersion);
  Put<uint8_t>(out, static_cast<uint8_t>(g.mode));
  Put<uint16_t>(out, 0);
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
  } else if (g.mode == GeometryMode::kDiag) {
    PutFloats(out, g.row_scale);
    PutFloats(out, g.col_scale);
  }
  Put<uint32_t>(out, Fnv1a(out.data(), out.size()));
  return out;
}

Geometry DeserializeGeometry(std::span<const uint8_t> bytes) {
  if (bytes.size() < kHeaderBytes + 4) {
    GEOFP8_FAIL("DeserializeGeometry: ", bytes.size(), " bytes is shorter than the header");
  }
  if (std::memcmp(bytes.data(), kMagic, 4) != 0) GEOFP8_FAIL("DeserializeGeometry: bad magic");
  uint32_t stored = 0;
  std::memcpy(&stored, bytes.data() + bytes.size() - 4, 4);
  const uint32_t actual = Fnv1a(bytes.data(), bytes.size() - 4);
  if (stored != actual) {
    GEOFP8_FAIL("DeserializeGeometry: checksum mismatch (stored ", stored, ", computed ", actual, ")");
  }
  Reader r{bytes.first(bytes.size() - 4), 4};
  const auto fv = r.Get<uint8_t>("format_version");
  if (fv != kFormatVersion) GEOFP8_FAIL("DeserializeGeometry: format_version ", int(fv), " unsupported");
  const auto mode = r.Get<uint8_t>("mode");
  if (mode > static_cast<uint8_t>(GeometryMode::kLowRank)) {
    GEOFP8_FAIL("DeserializeGeometry: mode: unknown value (", int(mode), "); accepted: ",
                AcceptedGeometryModes());
  }
  r.Get<uint16_t>("reserved");
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
  if (r.in.size() - r.pos != ArrayFloats(g) * sizeof(float)) {
    GEOFP8_FAIL("DeserializeGeometry: payload is ", r.in.size() - r.pos, " bytes, expected ",
                ArrayFloats(g) * sizeof(float));
  }
  if (g.mode == GeometryMode::kLowRank) {
    g.U = r.Floats(g.m * g.k, "U");
    g.V = r.Floats(g.n * g.k, "V");
    g.sigma = r.Floats(g.k, "sigma");
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

}  // namespace geofp8
