// Block random Hadamard rotation of a flattened tensor: each block of b consecutive elements is
// rotated by H_b D / sqrt(b) with seeded signs D, spreading an outlier over its codec scale block
// before quantization. Orthonormal and the same on every rank, so the sum commutes with it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "kernels/codec/codec.h"

namespace geofp8 {

inline constexpr int kMaxHadamardBlock = 4096;

// The signs' seed of one layer in a run: the same on every rank, different across layers.
uint64_t HadamardLayerSeed(uint64_t run_seed, uint32_t layer);

// The codec's scale block under `options`: 16 for nvfp4, 32 for mxfp8, options.block for block
// scaling; 0 when the scale does not work per block (fp32, bf16, tensor or no scaling).
uint32_t CodecScaleBlock(const CodecOptions& options);

// "" when `block` can rotate tensors encoded with `options`, else one line naming the field:
// a power of two in [2, 4096] that divides the codec's scale block (when it has one), e.g.
// "hadamard_block: must divide the codec's scale block 16 (32)".
std::string ValidateHadamardBlock(int block, const CodecOptions& options);

// In place over x, elements [first, first + x.size()) of a tensor; `first` must be a multiple of
// `block` (blocks are [k b, (k + 1) b) of the tensor, and the n % b tail only flips signs).
// AVX2 when the CPU has it and block >= 8, bit-identical to the GEOFP8_HD reference
// (hadamard_math.h), which `reference` forces. Throws geofp8::Error on a bad block or first.
void HadamardForward(std::span<float> x, int block, uint64_t seed, uint64_t first = 0,
                     bool reference = false);
void HadamardInverse(std::span<float> x, int block, uint64_t seed, uint64_t first = 0,
                     bool reference = false);

// Encode(forward(x)) without writing the rotated tensor to memory: tiles of whole blocks are
// rotated into a cache-resident buffer and encoded from there, for fp8 with block scaling and
// mxfp8 at nearest rounding (scales local to a block); other options rotate a full copy first.
// The bytes equal HadamardForward on a copy followed by Encode. `block` must pass
// ValidateHadamardBlock.
EncodeStats EncodeRotated(std::span<const float> x, int block, uint64_t seed,
                          const CodecOptions& options, std::span<uint8_t> out);

}  // namespace geofp8
