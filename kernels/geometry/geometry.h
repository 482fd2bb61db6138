// The GeoFP8 geometry: a per-layer linear map T that flattens a gradient's dominant singular
// directions before quantization, and its inverse after the exchange (DESIGN.md section 2).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

namespace geofp8 {

enum class GeometryMode : uint8_t {
  kNone = 0,     // identity: plain Euclidean quantization (always used for 1-D tensors)
  kDiag = 1,     // per-row and per-column RMS scaling, O(mn)
  kLowRank = 2,  // low-rank Kronecker whitening P_L G P_R with rank k
};
std::string_view GeometryModeName(GeometryMode m);  // "none", "diag", "lowrank"
std::optional<GeometryMode> ParseGeometryMode(std::string_view name);
std::string_view AcceptedGeometryModes();  // "none, diag, lowrank"

// A layer's transform as the job spec, `geofp8ctl policy set --geometry` and `geofp8-tool
// analyze --geometry` name it: the geometry, optionally followed by the block Hadamard rotation
// ("lowrank+hadamard"; "hadamard" alone is the rotation with geometry none).
struct GeometryTransform {
  GeometryMode geometry = GeometryMode::kNone;
  bool hadamard = false;
};
std::optional<GeometryTransform> ParseTransformName(std::string_view name);
// "none, diag, lowrank, hadamard, diag+hadamard, lowrank+hadamard"
std::string_view AcceptedTransformNames();

// How to estimate a geometry. Plain struct with defaults.
struct GeometryOptions {
  GeometryMode mode = GeometryMode::kLowRank;
  int rank = 16;          // k; clamped to min(m, n)
  float alpha = 0.25f;    // whitening exponent on each side (Shampoo's 1/4)
  int power_iters = 1;    // q: subspace iterations per refresh
  uint64_t seed = 0;      // cold-start random matrix
  float sigma_ema = 0.f;  // 0: no smoothing; else sigma = ema*old + (1-ema)*new across refreshes
};

// One layer's geometry. Matrices are row-major float32; the gradient G is m x n row-major.
struct Geometry {
  GeometryMode mode = GeometryMode::kNone;
  uint64_t version = 0;  // 0 = never estimated (warm-up: behaves as kNone)
  int64_t m = 0, n = 0;
  int k = 0;
  float alpha = 0.25f;
  std::vector<float> U;      // m x k, orthonormal columns (kLowRank)
  std::vector<float> V;      // n x k, orthonormal columns (kLowRank)
  std::vector<float> sigma;  // k singular values, descending (kLowRank)
  // The right side's k values when they differ from the left's (a Kronecker-factor sketch has
  // its own eigenvalues per factor); empty: both sides use sigma, as an SVD pairs them.
  std::vector<float> sigma_right;
  float delta_L = 0.f, delta_R = 0.f;       // residual energy per remaining dimension (kLowRank)
  std::vector<float> row_scale, col_scale;  // m and n positive scales (kDiag)

  bool is_identity() const { return mode == GeometryMode::kNone || version == 0; }
};

// What one refresh produced.
struct RefreshResult {
  Geometry geometry;
  double drift = 0.0;  // subspace distance to the previous basis, in [0, 1]; 0 on cold start
  double seconds = 0.0;
};

// Estimates the geometry of G (m x n) by randomized subspace iteration, warm-started from
// `previous` when it has the same shape and mode. Version is previous->version + 1 (or 1).
// Throws geofp8::Error if G holds a non-finite value. Never returns NaN.
RefreshResult EstimateGeometry(std::span<const float> G, int64_t m, int64_t n,
                               const GeometryOptions& options, const Geometry* previous);

// In-place T(G) and T^-1(G). Identity geometries leave G untouched. Thread-safe for distinct G.
void ApplyGeometry(const Geometry& geometry, std::span<float> G);
void InvertGeometry(const Geometry& geometry, std::span<float> G);

// What the lowrank inverse learns of its result G = T^-1(D) on the way: U^T G and G V for the
// geometry's own U and V, and ||G||_F^2. T^-1 reduces U^T D and D V over D anyway, and G's
// projections follow from those in O((m + n) k^2); the norm is summed over each row tile while it
// is in cache. The factor sketch (factor_sketch.h) needs exactly these of the averaged gradient,
// which is what spares it a pass over G.
struct InverseProducts {
  bool valid = false;  // false: not a lowrank inverse, or one whose factors were all 1
  int64_t m = 0, n = 0;
  int k = 0;
  const float* data = nullptr;  // the G they describe (for the caller's identity check)
  std::vector<float> U, V;      // copies of the basis they were taken against (m x k, n x k)
  std::vector<float> ug;        // U^T G, k x n row-major (G^T U column-major)
  std::vector<float> gv;        // G V, m x k row-major
  double norm2 = 0.0;           // ||G||_F^2 accumulated in double; non-finite if G is
};
// InvertGeometry that also fills `products` (when not null): valid only for a lowrank geometry
// whose inverse is not the identity. Each projection is within a few float round-offs of
// computing it from G, relative to ||G|| times the inverse's amplification 1 / min f.
void InvertGeometry(const Geometry& geometry, std::span<float> G, InverseProducts* products);

// T^-1 on a shard: rows [r0, r0 + rows.size() / n) of the m x n transformed matrix D, as an
// owner holds them after a reduce-scatter. diag's inverse is row-local, and so is the right factor
// of lowrank's; its left factor is not: with W = U^T D (k x n, summed over every row) it is, per
// row block, D_rows - [U_rows | D_rows V Bb - U_rows Ab (W V) Bb] [Ab W ; V^T] (the Woodbury
// cores Ab, Bb of InvertGeometry), so each owner finishes its rows once the k x n sums of
// ShardColumnProducts over every owner are in (one fp32 all-reduce of k/m of the layer).
// The rows of W that InvertGeometryRows needs (k for a lowrank geometry whose inverse is not the
// identity, else 0: no products, the inverse is row-local).
int ShardProductRows(const Geometry& geometry);
// w (ShardProductRows x n) = U[r0 .., :]^T rows: this shard's share of W.
void ShardColumnProducts(const Geometry& geometry, int64_t r0, std::span<const float> rows,
                         std::span<float> w);
// In place T^-1 on the shard; w = the sum of every shard's ShardColumnProducts (empty when
// ShardProductRows is 0). Matches InvertGeometry's rows up to float summation order.
void InvertGeometryRows(const Geometry& geometry, int64_t r0, std::span<float> rows,
                        std::span<const float> w);

// Subspace distance between two bases of equal shape: ||sin Theta||_2-style, in [0, 1].
double SubspaceDrift(const Geometry& a, const Geometry& b);

// Wire form for the owner's broadcast: self-describing, versioned, little-endian.
std::vector<uint8_t> SerializeGeometry(const Geometry& geometry);
Geometry DeserializeGeometry(std::span<const uint8_t> bytes);  // throws geofp8::Error if malformed

}  // namespace geofp8
