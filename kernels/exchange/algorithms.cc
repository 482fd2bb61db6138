// two_phase, allgather and the fp32/bf16 baselines over one bucket (see algorithms.h).
// two_phase: quantize every layer's chunk j for rank j, all-to-all, rank j decodes and sums its
// chunks in rank order in fp32, requantizes, all-gather, everyone decodes every chunk.
#include "kernels/exchange/algorithms.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/codec/codec.h"
#include "kernels/common/check.h"
#include "kernels/exchange/bf16.h"
#include "kernels/exchange/chunking.h"

namespace geofp8 {
namespace {

void RunFp32(Communicator& comm, std::span<const BucketLayer> layers) {
  size_t total = 0;
  for (const auto& l : layers) total += l.data.size();
  std::vector<float> flat(total);
  size_t off = 0;
  for (const auto& l : layers) {
    std::copy(l.data.begin(), l.data.end(), flat.begin() + off);
    off += l.data.size();
  }
  comm.AllReduceSum(flat);
  off = 0;
  for (const auto& l : layers) {
    std::copy_n(flat.begin() + off, l.data.size(), l.data.begin());
    off += l.data.size();
  }
}

void RunBf16(Communicator& comm, std::span<const BucketLayer> layers) {
  size_t total = 0;
  for (const auto& l : layers) total += l.data.size();
  std::vector<uint16_t> flat(total);
  size_t off = 0;
  for (const auto& l : layers) {
    for (float v : l.data) flat[off++] = FloatToBf16(v);
  }
  comm.AllReduceSumBf16(flat);
  off = 0;
  for (const auto& l : layers) {
    for (float& v : l.data) v = Bf16ToFloat(flat[off++]);
  }
}

void RunAllGather(Communicator& comm, uint64_t seed, uint64_t step,
                  std::span<const BucketLayer> layers) {
  const int n = comm.size();
  const uint32_t r = static_cast<uint32_t>(comm.rank());
  std::vector<CodecOptions> opts;
  size_t per_rank = 0;
  for (const auto& l : layers) {
    opts.push_back(LayerCodecOptions(l.policy, seed, step, l.layer, r, 1, 0));
    per_rank += EncodedBytes(opts.back(), l.data.size());
  }
  std::vector<uint8_t> mine(per_rank);
  size_t off = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    const size_t bytes = EncodedBytes(opts[i], layers[i].data.size());
    Encode(layers[i].data, opts[i], std::span(mine).subspan(off, bytes));
    off += bytes;
  }
  std::vector<uint8_t> all(per_rank * n);
  comm.AllGatherV(mine, all, std::vector<size_t>(n, per_rank));
  // Every rank sums the same bytes in the same (rank) order: identical results.
  off = 0;
  std::vector<size_t> layer_offset(layers.size());
  for (size_t i = 0; i < layers.size(); ++i) {
    layer_offset[i] = off;
    off += EncodedBytes(opts[i], layers[i].data.size());
    std::fill(layers[i].data.begin(), layers[i].data.end(), 0.f);
  }
  for (int src = 0; src < n; ++src) {
    for (size_t i = 0; i < layers.size(); ++i) {
      const size_t bytes = EncodedBytes(opts[i], layers[i].data.size());
      DecodeAccumulate(std::span<const uint8_t>(all).subspan(src * per_rank + layer_offset[i], bytes),
                       layers[i].data);
    }
  }
}

void RunTwoPhase(Communicator& comm, uint64_t seed, uint64_t step,
                 std::span<const BucketLayer> layers) {
  const int n = comm.size();
  const int r = comm.rank();
  const size_t L = layers.size();
  // chunk[i][j]: layer i's chunk for rank j; opts1[i][j]: this rank's phase-1 options for it.
  std::vector<std::vector<ChunkRange>> chunk(L, std::vector<ChunkRange>(n));
  std::vector<std::vector<CodecOptions>> opts1(L);
  std::vector<CodecOptions> opts2;  // requantization of this rank's own chunk of each layer
  for (size_t i = 0; i < L; ++i) {
    for (int j = 0; j < n; ++j) {
      opts1[i].push_back(LayerCodecOptions(layers[i].policy, seed, step, layers[i].layer, r, 1, j));
      chunk[i][j] = ChunkOf(layers[i].data.size(), ChunkAlignment(opts1[i][j]), n, j);
    }
    opts2.push_back(LayerCodecOptions(layers[i].policy, seed, step, layers[i].layer, r, 2, r));
  }
  // Encoded sizes depend only on the policy and the chunk length, so every rank knows them all.
  auto bytes_of = [&](size_t i, int j) { return EncodedBytes(opts1[i][0], chunk[i][j].size()); };
  std::vector<size_t> send_counts(n, 0), recv_counts(n, 0), gather_counts(n, 0);
  for (int j = 0; j < n; ++j) {
    for (size_t i = 0; i < L; ++i) send_counts[j] += bytes_of(i, j);
  }
  std::fill(recv_counts.begin(), recv_counts.end(), send_counts[r]);
  gather_counts = send_counts;  // requantized chunk j has the same encoded size as phase 1's

  size_t send_total = 0;
  for (size_t c : send_counts) send_total += c;
  std::vector<uint8_t> send(send_total);
  size_t off = 0;
  for (int j = 0; j < n; ++j) {
    for (size_t i = 0; i < L; ++i) {
      const size_t bytes = bytes_of(i, j);
      Encode(layers[i].data.subspan(chunk[i][j].begin, chunk[i][j].size()), opts1[i][j],
             std::span(send).subspan(off, bytes));
      off += bytes;
    }
  }
  std::vector<uint8_t> recv(send_counts[r] * n);
  comm.AllToAllV(send, send_counts, recv, recv_counts);

  // Sum this rank's chunk of every layer over sources in rank order, then requantize.
  std::vector<uint8_t> mine(send_counts[r]);
  off = 0;
  std::vector<float> acc;
  for (size_t i = 0; i < L; ++i) {
    const size_t len = chunk[i][r].size();
    const size_t bytes = bytes_of(i, r);
    acc.assign(len, 0.f);
    size_t layer_off = 0;
    for (size_t k = 0; k < i; ++k) layer_off += bytes_of(k, r);
    for (int src = 0; src < n; ++src) {
      DecodeAccumulate(std::span<const uint8_t>(recv).subspan(src * send_counts[r] + layer_off, bytes),
                       acc);
    }
    Encode(acc, opts2[i], std::span(mine).subspan(off, bytes));
    off += bytes;
  }

  size_t gather_total = 0;
  for (size_t c : gather_counts) gather_total += c;
  std::vector<uint8_t> all(gather_total);
  comm.AllGatherV(mine, all, gather_counts);
  off = 0;
  for (int j = 0; j < n; ++j) {
    for (size_t i = 0; i < L; ++i) {
      const size_t bytes = bytes_of(i, j);
      Decode(std::span<const uint8_t>(all).subspan(off, bytes),
             layers[i].data.subspan(chunk[i][j].begin, chunk[i][j].size()));
      off += bytes;
    }
  }
}

}  // namespace

void ExchangeBucketData(Communicator& comm, Algorithm algorithm, uint64_t seed, uint64_t step,
                        std::span<const BucketLayer> layers) {
  switch (algorithm) {
    case Algorithm::kFp32:
      return RunFp32(comm, layers);
    case Algorithm::kBf16:
      return RunBf16(comm, layers);
    case Algorithm::kAllGather:
      return RunAllGather(comm, seed, step, layers);
    case Algorithm::kTwoPhase:
      return RunTwoPhase(comm, seed, step, layers);
    case Algorithm::kNative:
      GEOFP8_FAIL("algorithm: native needs the nccl backend (backend ", comm.backend(), ")");
  }
  GEOFP8_FAIL("algorithm: unknown value ", static_cast<int>(algorithm), " (accepted: ",
              AcceptedAlgorithms(), ")");
}

}  // namespace geofp8
