// The sketch's pass over the gradient: Y = G X for a thin X, with ||G||_F^2 from the same read.
#pragma once

#include <cstdint>

namespace geofp8::geometry {

// Y (m x ldx, row-major) = G (m x n, row-major) X (n x ldx, row-major), and returns ||G||_F^2
// accumulated in double (non-finite when G holds a NaN or an infinity; a finite float's square
// cannot overflow a double). ldx >= 0 is a multiple of 8 (pad X with zero columns: Y's matching
// columns come back zero); ldx = 0 only sums the squares. m, n >= 1.
//
// On CPUs with AVX2 and FMA one register-blocked loop reads each row of G once for both results
// (OpenBLAS's sgemm first copies the whole of G into its packed layout at these widths, and the
// norm was a second pass); elsewhere cblas_sgemm and cblas_dsdot. Each output element is a float
// sum over j in index order (fused multiply-adds on AVX2): the same input gives the same bits on
// one machine, within n float round-offs of the exact product.
double ThinProductAndNorm(const float* g, int64_t m, int64_t n, const float* x, int ldx, float* y);

// The two reductions of the lowrank transform in one read of G (m x n, row-major): X = G V (m x 8)
// when x is not null, and W^T (n x 8) = G^T U, or += when `accumulate`, when wt is not null. U is
// m x 8 and V n x 8, row-major. Only for width 8 on CPUs with AVX2 and FMA, one register-blocked
// loop (OpenBLAS's sgemm first copies G into its packed layout for each of the two, which cost
// twice the multiplications); returns false having done nothing otherwise, and the caller uses
// BLAS. Each output element is a float sum in index order with fused multiply-adds: the same input
// gives the same bits on one machine, within n (or m) float round-offs of the exact product.
bool ThinBothSides(const float* g, int64_t m, int64_t n, const float* u, const float* v, int width,
                   float* x, float* wt, bool accumulate);

// out (k x k, row-major) = A^T B in double, for A and B (rows x k, row-major float): each product
// of two floats is exact in double, and each entry is summed over the rows in order, so the same
// input gives the same bits on every machine. One read of both (the k^2 strided dot products
// this replaced each read them again).
void CrossGram(const float* a, const float* b, int64_t rows, int k, double* out);

// out (k x k, row-major) = R^T R in double, R = B - A C (rows x k, formed in double), for A and B
// as above and C (k x k, row-major double): the Gram of B's residual outside span(A) when
// C = A^T B. The same bits on every machine, as for CrossGram.
void ResidualGram(const float* a, const float* b, const double* c, int64_t rows, int k,
                  double* out);

}  // namespace geofp8::geometry
