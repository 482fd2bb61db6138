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

}  // namespace geofp8::geometry
