// Forward and backward of the Llama building blocks on the CPU: embedding, RMSNorm, linear,
// rotary embedding, causal attention, SwiGLU, cross-entropy. GEMMs go through OpenBLAS cblas.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "kernels/model/ops_math.h"

namespace geofp8::model {

// Every op is templated on the scalar type: float for training, double for the finite-difference
// tests. Activations are row-major [T, width] with T = batch * seq tokens. Backward functions
// ACCUMULATE into parameter gradients (dW += ...) and OVERWRITE input gradients (dx = ...) unless
// the comment says otherwise.

// C[M,N] = alpha * op(A) op(B) + beta * C, row-major, through cblas_{s,d}gemm.
template <typename T>
void Gemm(bool trans_a, bool trans_b, int M, int N, int K, T alpha, const T* A, int lda, const T* B,
          int ldb, T beta, T* C, int ldc);

// Pins OpenBLAS to `threads` threads for the whole process (ranks on threads share it).
void SetBlasThreads(int threads);

// The kernel set OpenBLAS chose at load time, e.g. "SkylakeX" ("" for a non-OpenBLAS cblas).
std::string BlasCoreName();

// OpenBLAS picks its kernels once, at library load, from the CPU model, and falls back to
// generic SSE3 ("Prescott") kernels on models it does not know (Debian 12's 0.3.21 on Emerald
// Rapids), which runs sgemm several times slower. Returns the OPENBLAS_CORETYPE a program should
// re-execute itself with ("SkylakeX" for AVX-512, "Haswell" for AVX2+FMA) when the loaded core
// uses less of the CPU than it supports and OPENBLAS_CORETYPE is unset; "" otherwise.
std::string PreferredBlasCore();

// OpenBLAS reads OPENBLAS_CORETYPE only when it loads, before main: when PreferredBlasCore names a
// better kernel set, sets the variable and re-executes the program once (through the resolved
// binary path, so ps and perf keep its name). Returns only if no re-execution was needed or it
// failed; then `warning` gets one line to print ("" if none was needed).
void ReexecWithPreferredBlasCore(char** argv, std::string* warning);

// x[t, :] = table[tokens[t], :]; table is [vocab, d].
template <typename T>
void EmbeddingForward(std::span<const int32_t> tokens, const T* table, int d, T* x);
// dtable[tokens[t], :] += dx[t, :].
template <typename T>
void EmbeddingBackward(std::span<const int32_t> tokens, const T* dx, int d, T* dtable);

// y = x / sqrt(mean(x^2) + eps) * gain. Saves inv_rms[t] for the backward.
template <typename T>
void RmsNormForward(const T* x, const T* gain, int rows, int d, T eps, T* y, T* inv_rms);
// dx = (overwrite), dgain += .
template <typename T>
void RmsNormBackward(const T* x, const T* gain, const T* inv_rms, const T* dy, int rows, int d,
                     T* dx, T* dgain);

// y[T, out] = x[T, in] W^T with W [out, in] (a 2-D weight is the m x n = out x in gradient).
template <typename T>
void LinearForward(const T* x, const T* W, int rows, int in, int out, T* y);
// dx = dy W (overwrite when accumulate_dx is false, else dx +=), dW += dy^T x (dW = dy^T x when
// accumulate_dw is false: the model writes each weight's gradient once and skips zeroing it).
template <typename T>
void LinearBackward(const T* x, const T* W, const T* dy, int rows, int in, int out, T* dx, T* dW,
                    bool accumulate_dx = false, bool accumulate_dw = true);
// Only dW += dy^T x (for callers that want to publish dW before computing dx).
template <typename T>
void LinearBackwardWeight(const T* x, const T* dy, int rows, int in, int out, T* dW);

// Rotates each head's pairs (2i, 2i+1) by angle pos * theta^(-2i/head_dim), pos = t % seq.
// In place on x [T, heads*head_dim]. The backward is the rotation by the negative angle.
template <typename T>
void RopeForward(T* x, int rows, int seq, int heads, int head_dim, T theta);
template <typename T>
void RopeBackward(T* dx, int rows, int seq, int heads, int head_dim, T theta);
// The same with the angles' cos and sin [seq, head_dim/2] computed once (RopeTable) and applied
// to every q, k, dq, dk of a step (RopeApply; inverse: the backward's negative angle).
template <typename T>
void RopeTable(int seq, int head_dim, T theta, T* cos, T* sin);
template <typename T>
void RopeApply(T* x, int rows, int seq, int heads, int head_dim, const T* cos, const T* sin,
               bool inverse);

// Causal multi-head attention on q, k, v [batch*seq, heads*head_dim] (already rotated).
// probs [batch, heads, seq, seq] is saved for the backward; out [batch*seq, heads*head_dim].
template <typename T>
void AttentionForward(const T* q, const T* k, const T* v, int batch, int seq, int heads,
                      int head_dim, T* probs, T* out);
// dq, dk, dv overwritten. scratch needs seq*seq elements.
template <typename T>
void AttentionBackward(const T* q, const T* k, const T* v, const T* probs, const T* dout, int batch,
                       int seq, int heads, int head_dim, T* dq, T* dk, T* dv, T* scratch);

// h = silu(a) * b, elementwise over n.
template <typename T>
void SwiGluForward(const T* a, const T* b, int64_t n, T* h);
// da, db overwritten.
template <typename T>
void SwiGluBackward(const T* a, const T* b, const T* dh, int64_t n, T* da, T* db);

// Mean cross-entropy of logits [rows, vocab] against targets; writes dlogits = d(loss)/d(logits)
// when dlogits is non-null. Returns the loss (accumulated in double).
template <typename T>
double CrossEntropy(const T* logits, std::span<const int32_t> targets, int vocab, T* dlogits);

}  // namespace geofp8::model
