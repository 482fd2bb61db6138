// See hook_session.h. The device plane is compiled where the build has it
// (GEOFP8_HOOK_SESSION_CUDA: CUDA, cuBLAS and NCCL); elsewhere backend nccl is refused by name.
#include "kernels/exchange/hook_session.h"

#include <algorithm>
#include <utility>

#include "kernels/common/check.h"
#include "kernels/exchange/gloo_communicator.h"

#ifndef GEOFP8_HOOK_SESSION_CUDA
#define GEOFP8_HOOK_SESSION_CUDA 0
#endif
#if GEOFP8_HOOK_SESSION_CUDA
#include "kernels/exchange/cuda_backend.h"
#include "kernels/exchange/nccl_communicator.h"
#endif

namespace geofp8 {

const bool HookSession::kHasDevicePlane = GEOFP8_HOOK_SESSION_CUDA != 0;

HookSession::HookSession(Store& store, const HookSessionOptions& o) : rank_(o.rank) {
  // Whole milliseconds, the collectives' unit; NaN fails the comparison too.
  GEOFP8_CHECK(o.timeout.count() >= 0.001, "timeout: must be > 0 seconds, at least 0.001 (",
               o.timeout.count(), ")");
  EngineOptions eo;
  eo.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(o.timeout);
  eo.seed = o.seed;
  // A DDP bucket up to this size runs on the hook's thread as one group, with no pipeline
  // threads: DDP's first bucket (1 MiB) and small models' buckets, where thread handoffs cost
  // more than the overlap saves (docs/benchmarks.md, "DDP comm hooks"). Larger ones (DDP's
  // 25 MiB default) keep the pipeline, which overlaps the codec with the wire.
  eo.inline_bytes = size_t{4} << 20;
  // The hook reports no drift (its layer reports carry the exchange error only), so it does not
  // pay for it: about a twelfth of an EMA refresh at the GPT example's shapes.
  eo.measure_drift = false;
  GEOFP8_CHECK(o.backend == "gloo" || o.backend == "nccl", "backend: unknown value '", o.backend,
               "' (accepted: gloo, nccl)");
  if (o.backend == "nccl") {
#if GEOFP8_HOOK_SESSION_CUDA
    const int devices = CudaDeviceCount();
    GEOFP8_CHECK(devices > 0, "device: no CUDA device visible on rank ", o.rank);
    const int dev = o.device >= 0 ? o.device : o.rank % devices;
    GEOFP8_CHECK(dev < devices, "device: cuda:", dev, " out of range (", devices, " devices)");
    auto cuda = std::make_unique<cuda::CudaBackend>(dev);
    // NCCL moves the encoded wire in device memory, ordered with the codec's stream.
    NcclOptions no;
    no.device = dev;
    no.prefix = "geofp8";
    no.timeout = eo.timeout;
    no.stream = cuda->stream();
    comm_ = CreateNcclCommunicator(store, o.rank, o.size, no);
    cuda_ = cuda.get();
    device_ = std::move(cuda);
    plane_ = std::make_unique<StagedPlane>(*device_, WireMemory::kDevice);
    eo.plane = plane_.get();
#else
    GEOFP8_FAIL(
        "device: CUDA tensors need a CUDA build of geofp8 (where nvcc and NCCL are found: "
        "GEOFP8_ENABLE_CUDA=ON pip install --no-build-isolation ., or configure CMake with "
        "-DGEOFP8_ENABLE_CUDA=ON); this is the cpu build, the Gloo engine on CPU tensors only");
#endif
  } else {
    GlooOptions go;
    go.hostname = o.hostname;
    go.prefix = "geofp8";
    go.timeout = eo.timeout;
    comm_ = CreateGlooCommunicator(store, o.rank, o.size, go);
  }
  engine_ = std::make_unique<ExchangeEngine>(*comm_, eo);
}

HookSession::HookSession(std::unique_ptr<Store> store, const HookSessionOptions& o)
    : HookSession(*store, o) {
  store_ = std::move(store);
}

HookSession::~HookSession() {
  engine_->Stop();
  engine_.reset();
  comm_.reset();
}

void HookSession::SetLayers(const std::vector<std::string>& names,
                            const std::vector<std::pair<int64_t, int64_t>>& shapes) {
  GEOFP8_CHECK(names.size() == shapes.size(), "layers: ", names.size(), " names but ",
               shapes.size(), " shapes");
  GEOFP8_CHECK(!names.empty(), "layers: the model has no parameter that requires a gradient");
  std::vector<model::ParamInfo> params;
  std::vector<EngineLayer> layers;
  int64_t offset = 0;
  for (size_t i = 0; i < names.size(); ++i) {
    model::ParamInfo p;
    p.name = names[i];
    p.rows = shapes[i].first;
    p.cols = shapes[i].second;
    GEOFP8_CHECK(p.rows >= 1 && p.cols >= 1, "layers: parameter '", p.name, "' has shape (", p.rows,
                 ", ", p.cols, ")");
    p.offset = offset;
    offset += p.size();
    layers.push_back(EngineLayer{p.name, p.exchange_rows(), p.exchange_cols()});
    params.push_back(std::move(p));
  }
  engine_->SetLayers(std::move(layers));
  params_ = std::move(params);
}

const std::vector<model::ParamInfo>& HookSession::params() const {
  GEOFP8_CHECK(!params_.empty(), "policy: set_layers first");
  return params_;
}

void HookSession::CheckPolicy(const std::vector<LayerPolicy>& layers) const {
  GEOFP8_CHECK(layers.size() == params_.size(), "policy: ", layers.size(), " layer policies for ",
               params_.size(), " layers");
  if (!on_device()) return;
  for (size_t i = 0; i < params_.size(); ++i) {
    GEOFP8_CHECK(!layers[i].error_feedback, "policy: layer '", params_[i].name,
                 "': error_feedback, which the CUDA path of geofp8.torch does not run yet (use "
                 "CPU tensors)");
  }
}

void HookSession::SetPolicy(EnginePolicy policy) {
  CheckPolicy(policy.layers);
  engine_->SetPolicy(std::move(policy));
}

GradSpans HookSession::Spans(const FlatBucket& b) const {
  if (b.on_device) {
    GEOFP8_CHECK(on_device(),
                 "device: this engine runs on CPU tensors (backend gloo); create it "
                 "with backend 'nccl' for CUDA tensors");
  } else {
    GEOFP8_CHECK(!on_device(),
                 "device: this engine runs on CUDA tensors (backend nccl); CPU tensors "
                 "need a gloo engine");
  }
  GEOFP8_CHECK(engine_->has_policy(), "exchange: set_policy first");
#if GEOFP8_HOOK_SESSION_CUDA
  if (b.on_device) cuda_->CheckDeviceMemory(b.data.data, "bucket");
#endif
  GEOFP8_CHECK(b.layers.size() == b.offsets.size() && !b.layers.empty(),
               "exchange: ", b.layers.size(), " layers but ", b.offsets.size(), " offsets");
  const int64_t numel = static_cast<int64_t>(b.data.size());
  GradSpans grads;
  for (size_t i = 0; i < b.layers.size(); ++i) {
    GEOFP8_CHECK(b.layers[i] < params_.size(), "exchange: layer index ", b.layers[i],
                 " >= ", params_.size());
    const model::ParamInfo& p = params_[b.layers[i]];
    GEOFP8_CHECK(b.offsets[i] >= 0 && b.offsets[i] + p.size() <= numel, "exchange: layer '", p.name,
                 "' at offset ", b.offsets[i], " + ", p.size(), " is outside the bucket of ", numel,
                 " elements");
    grads.push_back(b.data.subspan(static_cast<size_t>(b.offsets[i]), size_t(p.size())));
  }
  return grads;
}

ExchangeEngine::Before HookSession::AfterStream(const FlatBucket& b) {
  if (!b.on_device) return {};
#if GEOFP8_HOOK_SESSION_CUDA
  struct Event {
    cuda::CudaBackend* cuda;
    uintptr_t event;
    ~Event() {
      if (event) cuda->ReleaseEvent(event);
    }
  };
  auto e = std::make_shared<Event>(Event{cuda_, cuda_->RecordEvent(b.stream)});
  return [e] { e->cuda->WaitForEvent(std::exchange(e->event, 0)); };
#else
  GEOFP8_FAIL("device: this geofp8 has no CUDA path");
#endif
}

StepResult HookSession::Exchange(uint64_t step, const FlatBucket& b,
                                 std::chrono::steady_clock::time_point* started) {
  GradSpans grads = Spans(b);
  return engine_->Exchange(step, b.layers, std::move(grads), AfterStream(b), started);
}

StepResult HookSession::ReduceScatter(uint64_t step, const FlatBucket& b, GradSpan out,
                                      const std::vector<int64_t>& out_offsets) {
  GradSpans grads = Spans(b);
  GEOFP8_CHECK(out_offsets.size() == b.layers.size(), "reduce-scatter: ", b.layers.size(),
               " layers but ", out_offsets.size(), " output offsets");
#if GEOFP8_HOOK_SESSION_CUDA
  if (b.on_device) cuda_->CheckDeviceMemory(out.data, "reduce-scatter output");
#endif
  const int64_t n = size(), room = static_cast<int64_t>(out.size());
  GradSpans outs;
  for (size_t i = 0; i < b.layers.size(); ++i) {
    const EngineLayer& l = engine_->layers()[b.layers[i]];
    const int64_t c = (l.rows + n - 1) / n;
    const int64_t mine = std::clamp<int64_t>(l.rows - c * rank_, 0, c) * l.cols;
    GEOFP8_CHECK(out_offsets[i] >= 0 && out_offsets[i] + mine <= room, "reduce-scatter: layer '",
                 l.name, "' at output offset ", out_offsets[i], " + ", mine,
                 " is outside the output of ", room, " elements");
    outs.push_back(out.subspan(static_cast<size_t>(out_offsets[i]), static_cast<size_t>(mine)));
  }
  return engine_->ReduceScatter(step, b.layers, std::move(grads), std::move(outs), AfterStream(b));
}

void HookSession::Submit(uint64_t step, const FlatBucket& b, ExchangeEngine::Done done) {
  GradSpans grads = Spans(b);
  engine_->Submit(step, b.layers, std::move(grads), std::move(done), AfterStream(b));
}

size_t HookSession::WriteTrace(const std::string& path) {
  GEOFP8_CHECK(engine_->trace(), "write_trace: no trace recorded (call start_trace first)");
  engine_->Drain(/*forget_errors=*/true);
  engine_->trace()->WriteChromeJson(path, rank_);
  return engine_->trace()->spans().size();
}

}  // namespace geofp8
