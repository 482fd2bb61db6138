// A streaming low-rank sketch of a layer gradient's Kronecker factors E[G G^T] and E[G^T G], kept
// as an exponential moving average over steps, and the lowrank geometry it yields.
#pragma once

// Why: the top-k subspace of a single small-batch gradient is replaced within a step or two, so a
// basis estimated from one gradient is stale when it is used (docs/benchmarks.md, "Geometry on
// training trajectories"). The anisotropy worth whitening is the persistent one, the statistics
// Shampoo, SOAP and K-FAC precondition with. Holding the m x m and n x n factors costs m^2 + n^2
// per layer, so each factor is kept as its top `width` eigenpairs instead and updated per step by a
// randomized range finder in O(mn * width): memory O((m + n) width).
//
// Every rank feeds the sketch the same post-exchange averaged gradient and runs the same code on
// the same BLAS kernels, so every rank holds the same sketch bit for bit and derives the same
// transform without any broadcast. That is the assumption the exchange already makes of the
// averaged gradient itself (its inverse transform runs on BLAS too, and the trainer compares
// parameter checksums across ranks); the exchange's fingerprint carries a digest of each layer's
// geometry, so a rank that computed differently is named within one step, never silently used.
//
// Cost per update, with c = 2 width + probes: 2 m n (width + probes) + 2 m n c flops in two thin
// products over G (the first, with ||G||^2, in one register-blocked pass on AVX2 machines; the
// second by sgemm); 2 m n probes + 2 m n (c - width) when the exchange's inverse transform hands
// over G V, U^T G and ||G||^2 (`known` below), as it does at interval 1: 2 m n width on an update
// without probes, in one register-blocked pass, O(m c^2) for one Cholesky QR2 orthonormalization on
// the left (Householder when the basis is ill-conditioned; own triangular solves), O(n (width +
// c)^2) for the right side's Gram (its top eigenpairs come from the Gram of a thin root of the
// right factor, no orthonormalization unless the spectrum is nearly flat or rank-deficient), O(c^3)
// for two small eigensolves (own Householder + QL, lapack.h). The eigensolves, the triangular
// solves and the fit's matrix-vector products run in plain loops on the calling thread, whatever
// OpenBLAS thread count the process set; the second product over G, the Gram matrices (dsyrk),
// Cholesky (dpotrf) and the small dgemms still call OpenBLAS, which threads the sgemm and the
// dgemms at n = 704. Memory: (m + n) width floats held, O((m + n) c) scratch.

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/geometry/geometry.h"

namespace geofp8 {

struct FactorSketchOptions {
  // Defaults measured on llama-small trajectories (docs/benchmarks.md): width 8 is as good as 16
  // at k = 8 for half the cost; beta 0.9 beats 0.7 and 0.95 in both windows.
  int width = 8;   // eigenpairs kept per factor; the exchange raises it to the rank k
  int probes = 4;  // fresh random directions per probing update, so new directions can enter
  // Probes join every probe_every-th update (and always the first): the EMA remembers about
  // 1 / (1 - beta) updates, so a direction that has entered once is kept between probes, and an
  // update without probes reads 8 columns of G in its first product instead of 16 (12 padded to
  // whole AVX registers) and solves smaller problems. On llama-small trajectories probes every
  // update, every 4th and never gave the same errors to 0.002 of Euclidean (docs/benchmarks.md).
  int probe_every = 4;
  float beta = 0.9f;  // EMA decay per update: factor = beta * factor + (1 - beta) * G G^T
  uint64_t seed = 0;  // probe signs derive from (seed, update count): the same on all ranks
};

// One layer's sketch. Plain data: ranks, checkpoints and tests compare it field by field.
struct FactorSketch {
  int64_t m = 0, n = 0;
  int width = 0;                    // columns held (<= options.width, <= min(m, n))
  uint64_t updates = 0;             // gradients folded in; 0 = empty
  std::vector<float> left;          // m x width, orthonormal columns (row-major)
  std::vector<double> left_energy;  // width eigenvalues of the left factor, descending
  std::vector<float> right;         // n x width
  std::vector<double> right_energy;
  double energy = 0.0;  // EMA of ||G||_F^2, the trace of either factor
  // How well the sketch's top-k basis, as it stood before the last update, fit that gradient:
  // the fraction of ||G||_F^2 inside span(U_k) (left) and span(V_k) (right), over the fraction the
  // sketch predicted. 1 when the gradient follows the persistent anisotropy, near 0 when the basis
  // has gone stale. Feeds the whitening strength and selective application.
  double fit = 1.0;
  int fit_k = 0;  // the k `fit` was measured at (0: not measured yet)
};

// Folds G (m x n, row-major float32, finite) into the sketch. `k` is the geometry rank whose fit
// is recorded. Throws geofp8::Error on a shape mismatch or a non-finite value.
//
// `known`, when given, is what the inverse transform that produced G (at the same address) knew
// of it (geometry.h InverseProducts). When its basis is bit for bit the sketch's whole held basis,
// as it is for the geometry derived from this sketch at its last update, the update takes G V,
// U^T G and ||G||^2 from it: its products over G shrink from (held + probes) + (2 held + probes)
// columns to the probes' plus (held + probes), and on an update without probes from 3 held to
// held. The result agrees with the update without `known` to float round-off, not bit for bit.
// Returns whether `known` was used.
bool UpdateFactorSketch(FactorSketch& sketch, std::span<const float> G, int64_t m, int64_t n, int k,
                        const FactorSketchOptions& options, const InverseProducts* known = nullptr);

// The only ways an update reads G: two thin products and a norm, wherever G lives. The host's
// (HostGradient) is what the span overload above uses; a device's (geometry_cuda.h,
// cuda::DeviceGradient) runs the products there and moves only the thin factors, so a refresh of
// a device gradient copies (m + n) (held + probes) floats instead of m n.
class GradientProducts {
 public:
  virtual ~GradientProducts() = default;
  // y = G x and ||G||_F^2 in double (non-finite when G holds a NaN or inf): x is n x ldx and y
  // m x ldx, row-major, host memory.
  virtual double ProductAndNorm(const float* x, int ldx, float* y) = 0;
  // bt = G^T q: q is m x c and bt n x c, column-major, host memory.
  virtual void TransposeProduct(const float* q, int c, float* bt) = 0;
  // The index of a NaN or inf in G, or -1 (the error message's).
  virtual int64_t FindNonFinite() = 0;
  // G's host address, which `known` products are matched against; null: none match.
  virtual const float* host_data() const { return nullptr; }
};

// G in host memory (row-major m x n): the CPU's thin products (thin_product.h) and sgemm.
class HostGradient final : public GradientProducts {
 public:
  HostGradient(const float* g, int64_t m, int64_t n) : g_(g), m_(m), n_(n) {}
  double ProductAndNorm(const float* x, int ldx, float* y) override;
  void TransposeProduct(const float* q, int c, float* bt) override;
  int64_t FindNonFinite() override;
  const float* host_data() const override { return g_; }

 private:
  const float* g_;
  int64_t m_, n_;
  std::vector<float> q8_, bt8_;  // the width-8 path's row-major operands
};

// The update over any GradientProducts of an m x n gradient; the span overload is this with a
// HostGradient, bit for bit.
bool UpdateFactorSketch(FactorSketch& sketch, GradientProducts& G, int64_t m, int64_t n, int k,
                        const FactorSketchOptions& options, const InverseProducts* known = nullptr);

// How the whitening strength follows the sketch's fit to the last gradient.
struct SketchGeometryOptions {
  int rank = 8;         // k: directions whitened per side, <= sketch width
  float alpha = 0.25f;  // full strength (Shampoo's 1/4)
  // Strength t = min(1, fit)^adapt scales the exponent: factors (e / delta)^(-alpha t), carried
  // in sigma (the geometry keeps alpha). 0 (the default) turns the adaptation off: on llama-small
  // trajectories adapt 1 left rel_fro unchanged and made the worst band worse (0.25 vs 0.20).
  float adapt = 0.0f;
};

// The lowrank geometry of the sketch: U, V its top-k eigenvectors, per-side energies from its
// eigenvalues and the bulk from the EMA energy left outside them. Identity (version 0) for an
// empty sketch. `version` is stamped on the result.
Geometry GeometryFromSketch(const FactorSketch& sketch, const SketchGeometryOptions& options,
                            uint64_t version);

// Wire and checkpoint form: little-endian, versioned, checksummed (as SerializeGeometry).
std::vector<uint8_t> SerializeFactorSketch(const FactorSketch& sketch);
FactorSketch DeserializeFactorSketch(std::span<const uint8_t> bytes);  // throws if malformed

// 64-bit digest of a geometry's numbers (FNV-1a's xor-multiply over the 8-byte words of its wire
// form, then a finalizer), for the exchange fingerprint: any one changed word changes it.
uint64_t GeometryDigest(const Geometry& geometry);

}  // namespace geofp8
