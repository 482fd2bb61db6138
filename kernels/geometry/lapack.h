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

// Orthonormal basis of A's columns by Cholesky QR applied twice (CholeskyQR2: Gram A^T A by
// dsyrk, Cholesky, triangular solve, then once more on the result), which costs about half the
// flops of Householder QR in BLAS-3 calls. A (rows x cols, rows >= cols, leading dimension rows)
// becomes Q and R = R2 R1 (cols x cols, upper triangular) is returned when
// r != nullptr (positive diagonal on the Cholesky path). Columns are equilibrated inside the first
// Gram, so columns of very different norms cost nothing. When the first Cholesky breaks down (A
// rank deficient or nearly so) or its Q is too far from orthonormal for the second pass to finish
// the job, the call falls back to Householder (QrInPlace) on the original A. Deterministic: the
// same input takes the same path and gives the same bits. Returns true when the Cholesky path was
// used.
bool OrthonormalizeInPlace(double* a, int64_t rows, int64_t cols, std::vector<double>* r);

// Calls of OrthonormalizeInPlace that fell back to Householder in this process (for benches and
// tests; relaxed atomic).
uint64_t OrthonormalizeFallbacks();

// Thin SVD A = U diag(s) V^T of A (rows x cols); A is destroyed. U is rows x p, Vt is p x cols,
// p = min(rows, cols), s descending.
struct Svd {
  std::vector<double> u, s, vt;
};
Svd ThinSvd(std::vector<double>& a, int64_t rows, int64_t cols);

// Fault injection for tests: the next ThinSvd on this thread treats divide and conquer (dgesdd)
// as failed to converge, so its QR-iteration fallback (dgesvd) runs whatever OpenBLAS kernel the
// machine picks (dgesdd fails on the test fixture with Haswell kernels only).
void FailNextDivideAndConquerForTest();

// Inverse of the general n x n matrix A (LU with partial pivoting); throws if A is singular.
std::vector<double> Inverse(std::vector<double> a, int64_t n);

// All eigenpairs of the symmetric n x n matrix A by LAPACK's dsyev: values descending, vectors
// (n x n, column j for value j) to match. The reference the tests check the small solver against;
// the geometry itself calls the two below.
void SymmetricEigen(std::vector<double> a, int64_t n, std::vector<double>& values,
                    std::vector<double>& vectors);

// All eigenpairs of the symmetric n x n matrix whose upper triangle A holds (column-major), in
// place: A becomes the eigenvectors, column j for values[j], values ascending. Householder
// tridiagonalisation and implicit-shift QL in plain loops on the calling thread (no BLAS, so no
// OpenBLAS thread pool whatever the process set), O(n^3): meant for the geometry's small problems
// (n up to a few hundred). Backward stable: the residual ||A v - lambda v|| is a small multiple
// of n eps ||A||. Deterministic: the same input gives the same bits. `work` is resized as needed
// (n^2 + 3n) and may be reused. Throws on a non-finite entry.
void SymmetricEigenInPlace(double* a, int64_t n, double* values, std::vector<double>& work);

// Largest eigenvalue of the symmetric n x n matrix A (its upper triangle is read; A is left as
// it was), by the same solver without vectors.
double LargestEigenvalue(std::vector<double>& a, int64_t n);

}  // namespace geofp8::geometry::lapack
