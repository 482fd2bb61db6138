// NCCL backend (see nccl_communicator.h). A collective on host spans copies them to a device
// staging buffer and back. The byte collectives also take device spans (TakesDeviceSpans: a
// device plane's wire, data_plane.h), which NCCL reads and writes where they lie: no staging, no
// host copy, ordered after the work issued so far on the engine's stream (NcclOptions::stream)
// by an event that this rank's stream waits for on the device. Every collective then runs on
// this rank's stream, which the calling thread polls against the timeout and the abort flag,
// aborting the communicator (ncclCommAbort) instead of hanging: the one thread that issues
// collectives waits for each, as the timeout needs, while the engine's stream runs on. The
// communicator is non-blocking (ncclConfig_t::blocking = 0): no NCCL call waits for a peer, so
// the rank's thread is always in the polling loop while a peer hangs, and Abort() from another
// thread (a Stop, a peer declared dead) takes effect within one poll.
#include "kernels/exchange/nccl_communicator.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "kernels/codec/codec.h"
#include "kernels/common/check.h"
#include "kernels/common/cuda_check.h"

#define GEOFP8_NCCL_CHECK(expr)                                                           \
  do {                                                                                    \
    const ncclResult_t geofp8_res = (expr);                                               \
    GEOFP8_CHECK(geofp8_res == ncclSuccess, #expr, ": ", ncclGetErrorString(geofp8_res)); \
  } while (0)

// On a non-blocking communicator a call may also answer ncclInProgress: the work is queued, and
// the caller polls ncclCommGetAsyncError until it settles (NcclCommunicator::Settle).
#define GEOFP8_NCCL_QUEUE(expr)                                                          \
  do {                                                                                   \
    const ncclResult_t geofp8_res = (expr);                                              \
    GEOFP8_CHECK(geofp8_res == ncclSuccess || geofp8_res == ncclInProgress, #expr, ": ", \
                 ncclGetErrorString(geofp8_res));                                        \
  } while (0)

namespace geofp8 {

int CudaDeviceCount() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return count;
}

namespace {

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 24, 0)
constexpr bool kNcclHasFp8 = true;
#else
constexpr bool kNcclHasFp8 = false;
#endif

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, cudaStream_t stream, cudaStream_t engine, int device, int rank,
                   int size, std::chrono::milliseconds timeout)
      : comm_(comm), stream_(stream), engine_(engine), device_(device), rank_(rank), size_(size) {
    timeout_ = timeout;
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_);
    native_fp8_ = kNcclHasFp8 && major >= 9;
  }

  ~NcclCommunicator() override {
    cudaSetDevice(device_);
    if (!comm_aborted_) {
      if (broken_ || abort_requested_.load()) {
        ncclCommAbort(comm_);
      } else {
        ncclCommDestroy(comm_);
      }
    }
    if (staging_) cudaFree(staging_);
    if (ready_) cudaEventDestroy(ready_);
    cudaStreamDestroy(stream_);
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "nccl"; }

  // Another thread (JobRunner's watchdog): the rank's own thread sees the flag within one poll
  // (50 us) of Wait/Settle, aborts the communicator there (ncclCommAbort, so that NCCL's own
  // threads and the peers' connections are torn down) and throws with `reason`. A later
  // collective throws at once.
  bool Abort(const std::string& reason) override {
    {
      std::lock_guard<std::mutex> lock(abort_mu_);
      if (abort_reason_.empty()) abort_reason_ = reason.empty() ? "aborted" : reason;
    }
    abort_requested_.store(true);
    return true;
  }
  bool HasNativeFp8() const override { return native_fp8_; }
  bool TakesDeviceSpans() const override { return true; }

  void AllToAllV(std::span<const uint8_t> send, std::span<const size_t> send_counts,
                 std::span<uint8_t> recv, std::span<const size_t> recv_counts) override {
    GEOFP8_CHECK(static_cast<int>(send_counts.size()) == size_ &&
                     static_cast<int>(recv_counts.size()) == size_,
                 "alltoallv: counts must have one entry per rank (", size_, ")");
    const size_t send_total = std::accumulate(send_counts.begin(), send_counts.end(), size_t{0});
    const size_t recv_total = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
    GEOFP8_CHECK(send.size() >= send_total && recv.size() >= recv_total,
                 "alltoallv: buffers smaller than their counts");
    ++stats_->collectives;
    stats_->bytes_sent += send_total - send_counts[rank_];
    const bool device = OnDevice("alltoallv", send.data(), recv.data());
    uint8_t* d = nullptr;  // the staging buffer: send, then recv
    if (device) {
      Ready();
    } else {
      d = Stage(send_total + recv_total);
    }
    const uint8_t* from = device ? send.data() : d;
    uint8_t* to = device ? recv.data() : d + send_total;
    if (!device) Upload(d, send.data(), send_total);
    Run("alltoallv", [&] {
      GEOFP8_NCCL_QUEUE(ncclGroupStart());
      size_t so = 0, ro = 0;
      for (int p = 0; p < size_; ++p) {
        if (send_counts[p])
          GEOFP8_NCCL_QUEUE(ncclSend(from + so, send_counts[p], ncclUint8, p, comm_, stream_));
        if (recv_counts[p]) {
          GEOFP8_NCCL_QUEUE(ncclRecv(to + ro, recv_counts[p], ncclUint8, p, comm_, stream_));
        }
        so += send_counts[p];
        ro += recv_counts[p];
      }
      GEOFP8_NCCL_QUEUE(ncclGroupEnd());
    });
    if (!device) Download(recv.data(), to, recv_total);
  }

  void AllGatherV(std::span<const uint8_t> send, std::span<uint8_t> recv,
                  std::span<const size_t> recv_counts) override {
    GEOFP8_CHECK(static_cast<int>(recv_counts.size()) == size_,
                 "allgatherv: recv_counts must have one entry per rank (", size_, ")");
    GEOFP8_CHECK(send.size() == recv_counts[rank_], "allgatherv: rank ", rank_, " sends ",
                 send.size(), " bytes but recv_counts says ", recv_counts[rank_]);
    const size_t total = std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0});
    GEOFP8_CHECK(recv.size() >= total, "allgatherv: recv buffer smaller than the counts");
    ++stats_->collectives;
    stats_->bytes_sent += send.size() * (size_ - 1);
    if (total == 0) return;
    const bool device = OnDevice("allgatherv", send.data(), recv.data());
    size_t my_off = 0;
    for (int p = 0; p < rank_; ++p) my_off += recv_counts[p];
    uint8_t* d = device ? recv.data() : Stage(total);
    if (device) {
      Ready();
      // Each rank's block is broadcast in place from its slot: ours is put there on the device.
      if (!send.empty() && send.data() != d + my_off) {
        GEOFP8_CUDA_CHECK(cudaMemcpyAsync(d + my_off, send.data(), send.size(),
                                          cudaMemcpyDeviceToDevice, stream_));
      }
    } else {
      Upload(d + my_off, send.data(), send.size());
    }
    // One broadcast per rank, fused in a group: NCCL has no all-gather with uneven parts.
    Run("allgatherv", [&] {
      GEOFP8_NCCL_QUEUE(ncclGroupStart());
      size_t off = 0;
      for (int p = 0; p < size_; ++p) {
        if (recv_counts[p]) {
          GEOFP8_NCCL_QUEUE(
              ncclBroadcast(d + off, d + off, recv_counts[p], ncclUint8, p, comm_, stream_));
        }
        off += recv_counts[p];
      }
      GEOFP8_NCCL_QUEUE(ncclGroupEnd());
    });
    if (!device) Download(recv.data(), d, total);
  }

  void AllReduceSum(std::span<float> data) override {
    AllReduce("allreduce fp32", data.data(), data.size(), ncclFloat32, ncclSum, sizeof(float));
  }

  void AllReduceSumBf16(std::span<uint16_t> data) override {
    AllReduce("allreduce bf16", data.data(), data.size(), ncclBfloat16, ncclSum, sizeof(uint16_t));
  }

  void Broadcast(std::span<uint8_t> data, int root) override {
    GEOFP8_CHECK(root >= 0 && root < size_, "broadcast: root ", root, " is not a rank of ", size_);
    ++stats_->collectives;
    if (rank_ == root) stats_->bytes_sent += data.size();
    if (data.empty()) return;
    uint8_t* d = Stage(data.size());
    Upload(d, data.data(), data.size());
    Run("broadcast", [&] {
      GEOFP8_NCCL_QUEUE(ncclBroadcast(d, d, data.size(), ncclUint8, root, comm_, stream_));
    });
    Download(data.data(), d, data.size());
  }

  uint32_t MaxReduce(uint32_t value) override {
    AllReduce("max-reduce", &value, 1, ncclUint32, ncclMax, sizeof(uint32_t));
    return value;
  }

  void MaxReduceWords(std::span<uint64_t> words) override {
    GEOFP8_CHECK(words.size() <= kMaxReduceWords, "max-reduce: ", words.size(), " words, at most ",
                 kMaxReduceWords);
    AllReduce("max-reduce", words.data(), words.size(), ncclUint64, ncclMax, sizeof(uint64_t));
  }

  void Barrier() override {
    uint32_t one = 1;
    AllReduce("barrier", &one, 1, ncclUint32, ncclSum, sizeof(uint32_t));
  }

  void AllReduceSumNativeFp8(std::span<float> data) override {
    if (!native_fp8_) Communicator::AllReduceSumNativeFp8(data);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 24, 0)
    // One scale for all ranks: the sum of N values of magnitude <= A fits in E4M3's 448.
    float amax = 0.f;
    for (float v : data) amax = std::max(amax, std::fabs(v));
    uint32_t bits;
    std::memcpy(&bits, &amax, 4);
    bits = MaxReduce(bits);  // non-negative floats order like their bit patterns
    std::memcpy(&amax, &bits, 4);
    GEOFP8_CHECK(std::isfinite(amax), "native: non-finite input reached the FP8 all-reduce");
    const float scale = amax > 0.f ? FormatMax(Format::kFp8E4M3) / (amax * size_) : 1.f;
    std::vector<float> scaled(data.size());
    for (size_t i = 0; i < data.size(); ++i) scaled[i] = data[i] * scale;
    // Raw E4M3 codes through the codec (scaling none): header then one byte per element.
    CodecOptions o;
    o.format = Format::kFp8E4M3;
    o.scaling = Scaling::kNone;
    std::vector<uint8_t> enc(EncodedBytes(o, data.size()));
    Encode(scaled, o, enc);
    const size_t header = sizeof(EncodedHeader) + ScaleBytes(o, data.size());
    std::span<uint8_t> codes(enc.data() + header, data.size());
    AllReduce("allreduce fp8_e4m3", codes.data(), codes.size(), ncclFloat8e4m3, ncclSum, 1);
    Decode(enc, data);
    for (float& v : data) v /= scale;
#endif
  }

 private:
  void AllReduce(const char* op, void* host, size_t count, ncclDataType_t type, ncclRedOp_t red,
                 size_t elem) {
    ++stats_->collectives;
    stats_->bytes_sent += 2 * (size_ - 1) * count * elem / size_;
    if (count == 0) return;
    uint8_t* d = Stage(count * elem);
    Upload(d, host, count * elem);
    Run(op, [&] { GEOFP8_NCCL_QUEUE(ncclAllReduce(d, d, count, type, red, comm_, stream_)); });
    Download(host, d, count * elem);
  }

  // Whether a byte collective's spans are device memory (then both must be, and of this rank's
  // device). Empty spans count as the other's kind.
  bool OnDevice(const char* op, const void* send, const void* recv) const {
    const int s = Kind(send), r = Kind(recv);
    const int kind = s >= 0 ? s : r;
    GEOFP8_CHECK(s < 0 || r < 0 || s == r, "nccl ", op, " on rank ", rank_, ": send is ",
                 s ? "device" : "host", " memory but recv is ", r ? "device" : "host",
                 " memory (both must be one or the other)");
    return kind == 1;
  }
  // 1: memory of this rank's device; 0: host memory; -1: no pointer.
  int Kind(const void* p) const {
    if (!p) return -1;
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
      (void)cudaGetLastError();  // older runtimes: unregistered host memory
      return 0;
    }
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged) return 0;
    GEOFP8_CHECK(attr.device == device_, "nccl on rank ", rank_, ": a span of cuda:", attr.device,
                 " given to the communicator of cuda:", device_);
    return 1;
  }

  // Before a collective on device spans: this rank's stream waits, on the device, for the work
  // issued so far on the engine's stream (the encodes that wrote the send span, the decodes that
  // read the recv span's last contents).
  void Ready() {
    Begin();
    GEOFP8_CHECK(engine_ != nullptr, "nccl on rank ", rank_,
                 ": device spans need the engine's stream (NcclOptions::stream) to order with");
    if (!ready_) GEOFP8_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
    GEOFP8_CUDA_CHECK(cudaEventRecord(ready_, engine_));
    GEOFP8_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
  }

  void Begin() {
    if (abort_requested_.load()) AbortNow("before the collective");
    GEOFP8_CHECK(!broken_, "nccl on rank ", rank_,
                 ": communicator is broken by an earlier failure");
    GEOFP8_CUDA_CHECK(cudaSetDevice(device_));
  }

  uint8_t* Stage(size_t bytes) {
    Begin();
    if (bytes > staging_bytes_) {
      if (staging_) GEOFP8_CUDA_CHECK(cudaFree(staging_));
      staging_ = nullptr;
      GEOFP8_CUDA_CHECK(cudaMalloc(&staging_, bytes));
      staging_bytes_ = bytes;
    }
    return static_cast<uint8_t*>(staging_);
  }

  void Upload(void* d, const void* h, size_t bytes) {
    if (bytes) GEOFP8_CUDA_CHECK(cudaMemcpyAsync(d, h, bytes, cudaMemcpyHostToDevice, stream_));
  }

  void Download(void* h, const void* d, size_t bytes) {
    if (bytes) GEOFP8_CUDA_CHECK(cudaMemcpyAsync(h, d, bytes, cudaMemcpyDeviceToHost, stream_));
    Wait("download");
  }

  template <typename Fn>
  void Run(const char* op, Fn&& enqueue) {
    try {
      enqueue();
    } catch (const Error& e) {
      broken_ = true;
      GEOFP8_FAIL("nccl ", op, " failed on rank ", rank_, ": ", e.what());
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    Settle(
        comm_, op, deadline, [this](const std::string& why) { AbortNow(why); }, &abort_requested_);
    Wait(op, deadline);
  }

  // ncclCommAbort on this thread, then throws with the reason Abort() was given (or `what`).
  [[noreturn]] void AbortNow(const std::string& what) {
    broken_ = true;
    if (!comm_aborted_) {
      ncclCommAbort(comm_);
      comm_aborted_ = true;
    }
    std::string reason;
    {
      std::lock_guard<std::mutex> lock(abort_mu_);
      reason = abort_reason_;
    }
    GEOFP8_FAIL("nccl on rank ", rank_, ": aborted (", reason.empty() ? what : reason, ")");
  }

 public:
  // Polls a non-blocking communicator until its queued calls have settled: ncclSuccess returns;
  // an error, the deadline or a set `*stop` calls `on_abort(why)`, which must throw. Static:
  // CreateNcclCommunicator needs it for ncclCommInitRankConfig.
  template <typename OnAbort>
  static void Settle(ncclComm_t comm, const char* op,
                     std::chrono::steady_clock::time_point deadline, OnAbort&& on_abort,
                     const std::atomic<bool>* stop = nullptr) {
    for (;;) {
      ncclResult_t state = ncclSuccess;
      const ncclResult_t got = ncclCommGetAsyncError(comm, &state);
      if (got != ncclSuccess) state = got;
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        on_abort(std::string(op) + " failed: " + ncclGetErrorString(state));
      }
      if (stop && stop->load()) on_abort(op);
      if (std::chrono::steady_clock::now() >= deadline) {
        on_abort(std::string(op) + " timed out while NCCL was still in progress");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

 private:
  // Polls the stream until done, an asynchronous NCCL error, Abort() or the deadline.
  void Wait(const char* op) { Wait(op, std::chrono::steady_clock::now() + timeout_); }
  void Wait(const char* op, std::chrono::steady_clock::time_point deadline) {
    for (;;) {
      if (abort_requested_.load()) AbortNow(op);
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) {
        broken_ = true;
        GEOFP8_FAIL("nccl ", op, " failed on rank ", rank_, ": ", cudaGetErrorString(q));
      }
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(comm_, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        broken_ = true;
        ncclCommAbort(comm_);  // NCCL's own threads may still be waiting on the peers
        comm_aborted_ = true;
        GEOFP8_FAIL("nccl ", op, " failed on rank ", rank_, ": ", ncclGetErrorString(async));
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        broken_ = true;
        ncclCommAbort(comm_);
        comm_aborted_ = true;
        GEOFP8_FAIL("nccl ", op, " on rank ", rank_, " timed out after ", timeout_.count(), " ms");
      }
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  ncclComm_t comm_;
  cudaStream_t stream_;
  cudaStream_t engine_;          // NcclOptions::stream; null: none given (host spans only)
  cudaEvent_t ready_ = nullptr;  // recorded on engine_ before a collective on device spans
  int device_, rank_, size_;
  bool native_fp8_ = false;
  bool broken_ = false;
  bool comm_aborted_ = false;  // ncclCommAbort done: the destructor must not touch comm_ again
  std::atomic<bool> abort_requested_{false};
  std::mutex abort_mu_;
  std::string abort_reason_;
  void* staging_ = nullptr;
  size_t staging_bytes_ = 0;
};

}  // namespace

std::unique_ptr<Communicator> CreateNcclCommunicator(Store& store, int rank, int size,
                                                     const NcclOptions& options) {
  GEOFP8_CHECK(size >= 1, "nccl: size must be >= 1 (", size, ")");
  GEOFP8_CHECK(rank >= 0 && rank < size, "nccl: rank must be in [0, ", size, ") (", rank, ")");
  const int devices = CudaDeviceCount();
  GEOFP8_CHECK(devices > 0, "nccl: no CUDA device visible on rank ", rank);
  const int device = options.device >= 0 ? options.device : rank % devices;
  GEOFP8_CHECK(device < devices, "nccl: device ", device, " out of range (", devices, " devices)");
  GEOFP8_CUDA_CHECK(cudaSetDevice(device));
  ncclUniqueId id;
  const std::string key = options.prefix + "/nccl_unique_id";
  if (rank == 0) {
    GEOFP8_NCCL_CHECK(ncclGetUniqueId(&id));
    store.Set(key, std::vector<uint8_t>(reinterpret_cast<uint8_t*>(&id),
                                        reinterpret_cast<uint8_t*>(&id) + sizeof id));
  } else {
    const auto bytes = store.Get(key, options.timeout);
    GEOFP8_CHECK(bytes.size() == sizeof id, "nccl: unique id under '", key, "' has ", bytes.size(),
                 " bytes, expected ", sizeof id);
    std::memcpy(&id, bytes.data(), sizeof id);
  }
  // Non-blocking (see the top of this file): initialisation returns at once and is polled.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  GEOFP8_NCCL_QUEUE(ncclCommInitRankConfig(&comm, size, id, rank, &config));
  NcclCommunicator::Settle(comm, "init", std::chrono::steady_clock::now() + options.timeout,
                           [&](const std::string& why) {
                             ncclCommAbort(comm);
                             GEOFP8_FAIL("nccl: rank ", rank, " of ", size, ": ", why);
                           });
  cudaStream_t stream;
  GEOFP8_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return std::make_unique<NcclCommunicator>(comm, stream,
                                            reinterpret_cast<cudaStream_t>(options.stream), device,
                                            rank, size, options.timeout);
}

}  // namespace geofp8
