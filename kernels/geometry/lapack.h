// Thin C++ wrappers over the few LAPACK routines the geometry needs (QR, SVD, symmetric eigen).
// Debian's OpenBLAS exports the Fortran LAPACK symbols but ships no lapacke.h, so we declare them.
#pragma once

#include <cstdint>
#include <vector>

namespace geofp8::geometry::lapack {

// All matrices here are column-major double with leading dimension = rows.

// Householder QR of A (rows x cols, rows >= cols) in place: A becomes Q with orthonormal columns,
// and R (cols x cols, upper triangular, column-major) is returned when r != nullptr.
// A rank-deficient or zero A still yields orthonormal Q.
void QrInPlace(std::vector<double>& a, int64_t rows, int64_t cols, std::vector<double>* r);

// Thin SVD A = U diag(s) V^T of A (rows x cols); A is destroyed. U is rows x p, Vt is p x cols,
// p = min(rows, cols), s descending.
struct Svd {
  std::vector<double> u, s, vt;
};
Svd ThinSvd(std::vector<double>& a, int64_t rows, int64_t cols);

// Inverse of the general n x n matrix A (LU with partial pivoting); throws if A is singular.
std::vector<double> Inverse(std::vector<double> a, int64_t n);

// All eigenpairs of the symmetric n x n matrix A: values descending, vectors (n x n, column j
// for value j) to match.
void SymmetricEigen(std::vector<double> a, int64_t n, std::vector<double>& values,
                    std::vector<double>& vectors);

// Largest eigenvalue of the symmetric n x n matrix A (A is destroyed).
double LargestEigenvalue(std::vector<double>& a, int64_t n);

}  // namespace geofp8::geometry::lapack
