// Test harness for the exchange engine's device plane (data_plane.h): the same steps through the
// host plane and through a StagedPlane over a DeviceBackend, compared. Used with a scrambled
// host-memory backend (data_plane_test.cc) and with the CUDA backend (cuda_plane_test.cc).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "kernels/exchange/chunking.h"
#include "kernels/exchange/data_plane.h"
#include "kernels/exchange/exchanger.h"
#include "tests/exchange/exchange_harness.h"

namespace geofp8::testing {

// A rank's gradients in a backend's memory.
struct DeviceTensors {
  DeviceBackend& backend;
  std::vector<float*> ptrs;
  std::vector<size_t> sizes;
  DeviceTensors(DeviceBackend& b, const Tensors& host) : backend(b) {
    for (const auto& t : host) {
      ptrs.push_back(static_cast<float*>(b.Allocate(std::max<size_t>(t.size(), 1) * 4)));
      sizes.push_back(t.size());
      b.ToDevice(ptrs.back(), t.data(), t.size() * 4);
    }
  }
  ~DeviceTensors() {
    for (float* p : ptrs) backend.Free(p);
  }
  std::vector<std::span<float>> spans() const {
    std::vector<std::span<float>> s;
    for (size_t l = 0; l < ptrs.size(); ++l) s.emplace_back(ptrs[l], sizes[l]);
    return s;
  }
  Tensors Download() const {
    Tensors out(ptrs.size());
    for (size_t l = 0; l < ptrs.size(); ++l) {
      out[l].resize(sizes[l]);
      backend.ToHost(out[l].data(), ptrs[l], sizes[l] * 4);
    }
    return out;
  }
};

// Both planes over the same inputs and steps: outputs [plane][rank][step][layer], results.
struct Runs {
  std::vector<std::vector<std::vector<Tensors>>> outputs;
  std::vector<std::vector<std::vector<StepResult>>> results;
  // The second run's communicator took device spans: it has no bounded receive (as NCCL), so
  // from the second step its fingerprint check is a round of its own where the first run's rides
  // in the data, and the bytes sent differ by that.
  bool device_wire = false;
};

using Mutate = std::function<void(int rank, uint64_t step, Tensors&)>;
// Each rank's backend (its own stream, on a GPU); `after` checks it once its plane is gone.
using BackendFactory = std::function<std::unique_ptr<DeviceBackend>(int rank)>;
using BackendCheck = std::function<void(int rank, DeviceBackend&)>;
// A communicator that takes the backend's memory (Communicator::TakesDeviceSpans) over a rank's
// Gloo one.
using DeviceComm = std::function<std::unique_ptr<Communicator>(Communicator&, DeviceBackend&)>;

// Runs `body` on each of n ranks (threads over Gloo) with an Exchanger over `layers`: first on the
// host plane (staged 0), then on a StagedPlane over the rank's backend (staged 1), whose wire is
// in the backend's memory over `device_comm` when one is given. `after` runs once the rank's
// plane is gone, before its backend.
using PlaneBody = std::function<void(int staged, int rank, Exchanger&, DeviceBackend&)>;
using PlaneAfter = std::function<void(int staged, int rank, DeviceBackend&)>;
inline void OnBothPlanes(const BackendFactory& make_backend, int n,
                         const std::vector<LayerSpec>& layers, const ExchangeOptions& options,
                         const std::vector<RefreshSchedule>& schedule,
                         const DeviceComm& device_comm, const PlaneBody& body,
                         const PlaneAfter& after) {
  for (int staged = 0; staged < 2; ++staged) {
    const auto errors = RunRanks(n, [&](Communicator& gloo) {
      const int r = gloo.rank();
      std::unique_ptr<DeviceBackend> owned = make_backend(r);
      DeviceBackend& backend = *owned;
      {
        const bool device_wire = staged && device_comm;
        std::unique_ptr<Communicator> wrapped = device_wire ? device_comm(gloo, backend) : nullptr;
        Communicator& comm = device_wire ? *wrapped : gloo;
        StagedPlane plane(backend, device_wire ? WireMemory::kDevice : WireMemory::kHost);
        ExchangeOptions o = options;
        if (staged) o.plane = &plane;
        Exchanger ex(comm, layers, o, schedule);
        body(staged, r, ex, backend);
      }
      after(staged, r, backend);
    });
    EXPECT_EQ(JoinErrors(errors), "") << (staged ? "staged plane" : "host plane");
  }
}

// `steps` steps of the same inputs through the host plane, then through a StagedPlane over each
// rank's backend, ranks as threads over Gloo. With `device_comm`, the StagedPlane keeps its wire
// in the backend's memory (WireMemory::kDevice) and the exchanger runs over that communicator.
inline Runs RunBothPlanes(const BackendFactory& make_backend, const BackendCheck& after, int n,
                          const std::vector<LayerSpec>& layers, const ExchangeOptions& options,
                          int steps, const std::vector<RefreshSchedule>& schedule = {},
                          const Mutate& mutate = {}, const DeviceComm& device_comm = {}) {
  Runs runs;
  runs.device_wire = static_cast<bool>(device_comm);
  runs.outputs.assign(2, std::vector<std::vector<Tensors>>(n));
  runs.results.assign(2, std::vector<std::vector<StepResult>>(n));
  OnBothPlanes(
      make_backend, n, layers, options, schedule, device_comm,
      [&](int staged, int r, Exchanger& ex, DeviceBackend& backend) {
        for (int s = 0; s < steps; ++s) {
          Tensors data = MakeInputs(r, layers, s);
          if (mutate) mutate(r, s, data);
          if (staged) {
            DeviceTensors dev(backend, data);
            runs.results[1][r].push_back(ex.Exchange(s, dev.spans()));
            runs.outputs[1][r].push_back(dev.Download());
          } else {
            std::vector<std::span<float>> grads;
            for (auto& t : data) grads.emplace_back(t);
            runs.results[0][r].push_back(ex.Exchange(s, grads));
            runs.outputs[0][r].push_back(data);
          }
        }
      },
      [&](int, int r, DeviceBackend& backend) {
        if (after) after(r, backend);
      });
  return runs;
}

inline void ExpectSame(const Runs& runs, const std::vector<LayerSpec>& layers,
                       const std::string& what) {
  const size_t n = runs.outputs[0].size();
  for (size_t r = 0; r < n; ++r) {
    ASSERT_EQ(runs.outputs[1][r].size(), runs.outputs[0][r].size()) << what;
    for (size_t s = 0; s < runs.outputs[0][r].size(); ++s) {
      const StepResult& a = runs.results[0][r][s];
      const StepResult& b = runs.results[1][r][s];
      EXPECT_EQ(b.skipped, a.skipped) << what << " rank " << r << " step " << s;
      if (!runs.device_wire || s == 0) {
        EXPECT_EQ(b.bytes_sent, a.bytes_sent) << what << " rank " << r << " step " << s;
      }
      ASSERT_EQ(b.buckets.size(), a.buckets.size());
      for (size_t k = 0; k < a.buckets.size(); ++k) {
        EXPECT_EQ(b.buckets[k].skipped, a.buckets[k].skipped) << what << " bucket " << k;
      }
      EXPECT_EQ(b.refreshes.size(), a.refreshes.size()) << what << " rank " << r << " step " << s;
      for (size_t l = 0; l < layers.size(); ++l) {
        if (a.skipped) continue;  // a skipped bucket's values have no meaning
        ASSERT_TRUE(SameBytes(runs.outputs[1][r][s][l], runs.outputs[0][r][s][l]))
            << what << ": rank " << r << " step " << s << " layer " << layers[l].name
            << " differs from the host plane at element "
            << FirstBitDifference(runs.outputs[1][r][s][l], runs.outputs[0][r][s][l]);
      }
    }
  }
}

inline std::vector<LayerSpec> MixedLayers() {
  LayerPolicy rotated = Policy(Format::kFp8E4M3, Scaling::kBlock, 32);
  rotated.hadamard = true;
  LayerPolicy stochastic = Policy(Format::kNvfp4, Scaling::kBlock, 16, Rounding::kStochastic);
  return {
      {"embed", 40, 96, Policy(Format::kFp8E4M3, Scaling::kBlock, 128)},
      {"attn.w", 32, 64, rotated},
      {"mlp.w", 48, 80, stochastic},
      {"head.w", 24, 50, Policy(Format::kFp8E5M2, Scaling::kTensor, 0)},
      {"norm", 77, 1, Policy(Format::kFp8E4M3, Scaling::kBlock, 128)},
  };
}

// ---- bf16 and fp16 gradients, and reduce-scatter ----

using Bytes = std::vector<uint8_t>;

inline size_t ElementBytes(GradDtype dtype) { return dtype == GradDtype::kFp32 ? 4 : 2; }

// `values` rounded to `dtype` (fp32: as they are), as raw bytes.
inline Bytes AsDtype(const std::vector<float>& values, GradDtype dtype) {
  Bytes b(values.size() * ElementBytes(dtype));
  StoreRounded(values, GradSpan(b.data(), values.size(), dtype));
  return b;
}

struct DtypeRun {
  std::vector<GradDtype> dtypes;  // each layer's gradient (and reduce-scatter output)
  bool reduce_scatter = false;    // ReduceScatter instead of Exchange
  bool device_wire = false;       // for the caller: pass a DeviceComm to RunDtypes
  std::vector<RefreshSchedule> schedule;
  Mutate mutate;  // the fp32 inputs before they are rounded to their dtypes
};

// Outputs [plane][rank][step][layer] as raw bytes (the exchanged gradients, or a reduce-scatter's
// rows), and the step results.
struct ByteRuns {
  std::vector<std::vector<std::vector<std::vector<Bytes>>>> outputs;
  std::vector<std::vector<std::vector<StepResult>>> results;
};

// As RunBothPlanes, with each layer's gradient (and a reduce-scatter's output, this rank's rows)
// in its dtype: the fp32 inputs rounded to it, the same bytes on both planes. `after` checks the
// staged run's backend once its plane is gone.
inline ByteRuns RunDtypes(const BackendFactory& make_backend, const BackendCheck& after, int n,
                          const std::vector<LayerSpec>& layers, const ExchangeOptions& options,
                          int steps, const DtypeRun& run, const DeviceComm& device_comm = {}) {
  ByteRuns runs;
  runs.outputs.assign(2, std::vector<std::vector<std::vector<Bytes>>>(n));
  runs.results.assign(2, std::vector<std::vector<StepResult>>(n));
  OnBothPlanes(
      make_backend, n, layers, options, run.schedule, device_comm,
      [&](int staged, int r, Exchanger& ex, DeviceBackend& backend) {
        for (int s = 0; s < steps; ++s) {
          Tensors values = MakeInputs(r, layers, s);
          if (run.mutate) run.mutate(r, s, values);
          std::vector<Bytes> in(layers.size()), out(layers.size());
          std::vector<void*> device;  // the staged run's buffers, in the order of `host`
          std::vector<Bytes*> host;
          auto place = [&](Bytes& b, size_t count, GradDtype d) {
            if (!staged) return GradSpan(b.data(), count, d);
            void* p = backend.Allocate(std::max<size_t>(b.size(), 1));
            backend.ToDevice(p, b.data(), b.size());
            device.push_back(p);
            host.push_back(&b);
            return GradSpan(p, count, d);
          };
          GradSpans grads, outs;
          for (size_t l = 0; l < layers.size(); ++l) {
            const GradDtype d = run.dtypes[l];
            in[l] = AsDtype(values[l], d);
            grads.push_back(place(in[l], values[l].size(), d));
            if (run.reduce_scatter) {
              const size_t mine = RowChunkOf(values[l].size(), size_t(layers[l].cols), n, r).size();
              out[l].assign(mine * ElementBytes(d), 0xEE);
              outs.push_back(place(out[l], mine, d));
            }
          }
          runs.results[staged][r].push_back(run.reduce_scatter ? ex.ReduceScatter(s, grads, outs)
                                                               : ex.Exchange(s, grads));
          for (size_t k = 0; k < device.size(); ++k) {
            backend.ToHost(host[k]->data(), device[k], host[k]->size());
            backend.Free(device[k]);
          }
          runs.outputs[staged][r].push_back(run.reduce_scatter ? out : in);
        }
      },
      [&](int staged, int r, DeviceBackend& backend) {
        if (staged && after) after(r, backend);
      });
  return runs;
}

inline void ExpectSameBytes(const ByteRuns& runs, const std::vector<LayerSpec>& layers,
                            const std::string& what) {
  for (size_t r = 0; r < runs.outputs[0].size(); ++r) {
    ASSERT_EQ(runs.outputs[1][r].size(), runs.outputs[0][r].size()) << what;
    for (size_t s = 0; s < runs.outputs[0][r].size(); ++s) {
      const StepResult& a = runs.results[0][r][s];
      const StepResult& b = runs.results[1][r][s];
      EXPECT_EQ(b.skipped, a.skipped) << what << " rank " << r << " step " << s;
      EXPECT_EQ(b.refreshes.size(), a.refreshes.size()) << what << " rank " << r << " step " << s;
      if (a.skipped) continue;  // a skipped bucket's values have no meaning
      for (size_t l = 0; l < layers.size(); ++l) {
        const Bytes& x = runs.outputs[0][r][s][l];
        const Bytes& y = runs.outputs[1][r][s][l];
        ASSERT_EQ(y.size(), x.size()) << what << " layer " << layers[l].name;
        size_t first = x.size();
        for (size_t i = 0; i < x.size() && first == x.size(); ++i) {
          if (x[i] != y[i]) first = i;
        }
        EXPECT_EQ(first, x.size())
            << what << ": rank " << r << " step " << s << " layer " << layers[l].name
            << " differs from the host plane at byte " << first << " of " << x.size();
      }
    }
  }
}

}  // namespace geofp8::testing
