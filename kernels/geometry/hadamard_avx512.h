// The AVX-512 path of EncodeRotated (hadamard.h), chosen at run time where the CPU has
// AVX-512 F/BW/DQ/VL: a codec block is rotated and encoded without leaving registers. Internal to
// kernels/geometry; hadamard.cc calls it and falls back to the AVX2 tile path where it declines.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/codec/codec.h"
#include "kernels/codec/codec_internal.h"

namespace geofp8::detail {

// Encodes the rotation (block rb, signs from `seed`) of x[0..n), tensor elements [0, n), into the
// scales and payload of layout `l` (the whole tensor's), bit-identical to HadamardForward then
// Encode. Covers nearest rounding for fp8 E4M3/E5M2 with block scaling at codec blocks 16, 32,
// 64 and 128, and mxfp8; rb in {16, ..., codec block}; n a multiple of the codec block. Returns
// false, writing nothing, for any other case, without AVX-512, or when Avx512Enabled() is false.
bool EncodeRotatedAvx512(const float* x, size_t n, int rb, uint64_t seed, const Layout& l,
                         uint8_t* scales, uint8_t* payload, EncodeStats* stats);

// nvfp4 at nearest rounding and rotation block 16, the whole tensor (two rotation passes: the
// tensor amax, then the blocks). Returns false, with nothing written that counts, without
// AVX-512, for another rotation block, or when a rotated value is not finite.
bool EncodeRotatedNvAvx512(const float* x, size_t n, int rb, uint64_t seed, const Layout& l,
                           uint8_t* scales, uint8_t* payload, EncodeStats* stats);

}  // namespace geofp8::detail
