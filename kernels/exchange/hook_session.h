// The exchange engine of one process group as a framework's gradient hook drives it (geofp8.torch's
// DDP comm hook and FSDP2 reduce-scatter, through client/python/engine_binding.cc).
//
// It connects the ranks through a Store (Gloo on host memory, or NCCL with the device plane for
// CUDA memory), owns the communicator, the device plane and the ExchangeEngine, and takes a bucket
// as the framework hands it over: one flat float32 buffer and each layer's offset in it. A binding
// over it only converts arguments and results and handles its interpreter's lock.
//
//   HookSession s(store, {.rank = r, .size = n});
//   s.SetLayers({"fc.weight", "fc.bias"}, {{64, 32}, {1, 64}});
//   s.SetPolicy(policy);                               // an EnginePolicy (platform/policy's plan)
//   s.Exchange(step, {{1, 0}, flat, {0, 64}});         // averaged in place
//   s.Submit(step, {{1, 0}, flat, {0, 64}}, done);     // the same on the engine's exchange thread
//   s.engine().Drain();                                // everything else: the engine itself
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "kernels/exchange/data_plane.h"
#include "kernels/exchange/engine.h"
#include "kernels/exchange/store.h"
#include "kernels/model/model.h"

namespace geofp8 {

namespace cuda {
class CudaBackend;
}  // namespace cuda

struct HookSessionOptions {
  int rank = 0;
  int size = 1;
  // "gloo": host memory; "nccl": device memory through the device plane (a build with CUDA,
  // cuBLAS and NCCL: HookSession::kHasDevicePlane).
  std::string backend = "gloo";
  int device = -1;                     // backend nccl: the CUDA device; -1: rank % devices visible
  std::string hostname = "127.0.0.1";  // backend gloo: the address the peers reach this rank on
  // The rendezvous and every collective's, in seconds as a binding passes it: at least 0.001,
  // kept in whole milliseconds.
  std::chrono::duration<double> timeout{300.0};
  uint64_t seed = 0;  // stochastic rounding streams and geometry cold starts
};

// One bucket as a framework hands it over: one flat buffer holding some layers, float32, or
// bfloat16/float16 on the host (read and written back in that dtype, grad_span.h).
struct FlatBucket {
  std::vector<uint32_t> layers;  // indices into SetLayers' list, distinct
  GradSpan data;                 // host memory; device memory (float32) when on_device
  std::vector<int64_t> offsets;  // layer layers[i] is data[offsets[i] .. + its size)
  bool on_device = false;        // data is CUDA memory (backend nccl only)
  // on_device: the CUDA stream (a cudaStream_t as an integer) whose work queued by the time of
  // the call the exchange follows (an event recorded then, waited for on the plane's stream).
  uintptr_t stream = 0;
};

class HookSession {
 public:
  // Whether this build has the device plane (backend nccl).
  static const bool kHasDevicePlane;

  // Connects rank options.rank of options.size through `store` (which must outlive the session)
  // and blocks until all have joined. Errors name the field (backend, device, timeout).
  HookSession(Store& store, const HookSessionOptions& options);
  // The same over a store the session keeps until it has closed its communicator (a binding's
  // store, which nothing else owns).
  HookSession(std::unique_ptr<Store> store, const HookSessionOptions& options);
  // The engine's Stop, then its queue dropped: a bucket still queued is dropped with its Done
  // uncalled; one on the wire is stopped through the communicator.
  ~HookSession();
  HookSession(const HookSession&) = delete;
  HookSession& operator=(const HookSession&) = delete;

  bool on_device() const { return plane_ != nullptr; }
  const char* backend() const { return on_device() ? "nccl" : "gloo"; }
  int rank() const { return rank_; }
  int size() const { return comm_->size(); }

  // The model's parameters in the framework's order: names and shapes (rows, cols); a 1-D
  // parameter is (1, n). Forgets the policy and every layer's state. Errors name the parameter.
  void SetLayers(const std::vector<std::string>& names,
                 const std::vector<std::pair<int64_t, int64_t>>& shapes);
  // The layers as the plan builders resolve a policy against them (platform/policy); throws
  // before SetLayers.
  const std::vector<model::ParamInfo>& params() const;

  // Refuses what this session's plane cannot run, naming the layer: the device plane runs every
  // policy the host does but error feedback (data_plane.h), refused here rather than when the
  // first bucket forms its exchanger. `layers`: one policy per layer.
  void CheckPolicy(const std::vector<LayerPolicy>& layers) const;
  // CheckPolicy, then ExchangeEngine::SetPolicy (geometry carries over where it still fits).
  void SetPolicy(EnginePolicy policy);

  // ExchangeEngine::Exchange of a flat bucket; `started` as there.
  StepResult Exchange(uint64_t step, const FlatBucket& bucket,
                      std::chrono::steady_clock::time_point* started = nullptr);
  // ExchangeEngine::ReduceScatter of a bucket: this rank's rows of layer layers[i] (FSDP's dim-0
  // chunk, ceil(rows / N) rows, fewer or none at the end) go to out[out_offsets[i] ..], memory of
  // the bucket's kind (a device bucket's: after its stream, as Exchange); the bucket is clobbered.
  StepResult ReduceScatter(uint64_t step, const FlatBucket& bucket, GradSpan out,
                           const std::vector<int64_t>& out_offsets);
  // ExchangeEngine::Submit of a flat bucket: its memory must stay valid and untouched until
  // `done` is called. Checked before anything is queued.
  void Submit(uint64_t step, const FlatBucket& bucket, ExchangeEngine::Done done);

  // From any thread: the collective in flight, and every later one, throw with an error carrying
  // `reason` (Communicator::Abort); the session is broken afterwards. False: the communicator
  // cannot interrupt a collective, which then ends at its timeout.
  bool Abort(const std::string& reason) { return comm_->Abort(reason); }

  // Chrome trace JSON of what was recorded since engine().StartTrace() (after the submitted
  // buckets), this rank as process `rank`. Returns the number of spans written.
  size_t WriteTrace(const std::string& path);

  // Everything else (Drain, in_flight, AgreeMin, geometry and residuals, StartTrace) is the
  // engine's own.
  ExchangeEngine& engine() { return *engine_; }

 private:
  // The bucket's layers as spans of its buffer, checked against the layers and the plane.
  GradSpans Spans(const FlatBucket& bucket) const;
  // Orders a device bucket's exchange after the work queued on its stream by now; empty for a
  // host bucket. An event whose bucket is dropped unexchanged is released, never waited for.
  ExchangeEngine::Before AfterStream(const FlatBucket& bucket);

  std::unique_ptr<Store> store_;  // the owning constructor's; destroyed after the communicator
  int rank_ = 0;
  std::unique_ptr<Communicator> comm_;     // gloo, or nccl for device memory
  std::unique_ptr<DeviceBackend> device_;  // backend nccl: the device plane's kernels
  cuda::CudaBackend* cuda_ = nullptr;      // device_, for its events and memory checks
  std::unique_ptr<StagedPlane> plane_;     // backend nccl; null: host memory
  std::unique_ptr<ExchangeEngine> engine_;
  std::vector<model::ParamInfo> params_;
};

}  // namespace geofp8
