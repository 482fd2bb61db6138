// CUDA encode / decode / decode-accumulate of the codec, on device buffers. Same wire bytes and
// same decoded bits as the CPU path: both call the GEOFP8_HD math in kernels/codec/element.h.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/codec/codec.h"

namespace geofp8::cuda {

// True when the CUDA kernels were compiled in and a device is visible.
bool DeviceAvailable();

// Encodes n floats at device pointer x into device buffer out (out_bytes >= EncodedBytes).
// `stream` is a cudaStream_t (nullptr: the default stream). Synchronizes the stream to return
// the stats. Throws geofp8::Error on invalid options or a CUDA failure.
EncodeStats Encode(const float* x, size_t n, const CodecOptions& options, uint8_t* out,
                   size_t out_bytes, void* stream = nullptr);

// The same bytes with no wait for the device: the header, its non-finite flag included, is
// written by a kernel, and nothing is returned. The exchange's device plane encodes with it.
void EncodeAsync(const float* x, size_t n, const CodecOptions& options, uint8_t* out,
                 size_t out_bytes, void* stream = nullptr);

// Decodes the encoded device buffer `in` into device floats out[0..n) (n must equal the
// header's count); with accumulate, out[i] += decoded[i]. Reads the header back to the host
// (synchronous), then runs asynchronously on `stream`.
void Decode(const uint8_t* in, size_t in_bytes, float* out, size_t n, bool accumulate = false,
            void* stream = nullptr);

// The same without reading the header: the layout is the one `options` gives n elements (the
// exchange knows every block's format, scaling and count from the layers' policies, and the
// fingerprint check has compared them across ranks), so nothing waits for the device.
void DecodeAs(const uint8_t* in, size_t in_bytes, const CodecOptions& options, float* out, size_t n,
              bool accumulate = false, void* stream = nullptr);

}  // namespace geofp8::cuda
