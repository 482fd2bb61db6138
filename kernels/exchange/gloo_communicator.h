// Gloo backend of the Communicator: TCP transport, full-mesh rendezvous through a geofp8::Store.
// Also the adapter that lets gloo's rendezvous use any geofp8::Store.
#pragma once

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <memory>
#include <string>

#include "kernels/exchange/communicator.h"
#include "kernels/exchange/store.h"

namespace geofp8 {

// gloo::rendezvous::Store over a geofp8::Store: set/get/wait map one to one; get and the
// timeout-less wait use `timeout`.
class GlooStoreAdapter final : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(geofp8::Store& store, std::chrono::milliseconds timeout)
      : store_(store), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

 private:
  geofp8::Store& store_;
  std::chrono::milliseconds timeout_;
};

struct GlooOptions {
  // Address this rank listens on: 127.0.0.1 for ranks as threads, the namespace's address for
  // bench/netem.sh.
  std::string hostname = "127.0.0.1";
  // Keys are written under "<prefix>/..." so several groups can share one store.
  std::string prefix = "geofp8";
  // Rendezvous and collective timeout.
  std::chrono::milliseconds timeout = kDefaultCollectiveTimeout;
  // Full meshes of connections: 2 gives the communicator a side_channel(), on which two_phase
  // overlaps its all-gathers with its next all-to-alls; 1 halves the sockets (2(N-1) per rank
  // with 2).
  int channels = 2;
  // Niceness added to Gloo's event-loop thread, in [0, 19]. That thread polls epoll again at once
  // when another thread holds the connection's lock, so on oversubscribed cores it can keep the
  // lock holder off the CPU until the next tick: a small collective then costs ~4 ms instead of
  // ~0.4 ms. A lower priority lets the holder run, but the loop also does the bulk reads and
  // writes, which then lose to codec threads (docs/benchmarks.md: both effects measured).
  int loop_nice = 0;
};

// Connects rank `rank` of `size` (blocking until all ranks have joined or the timeout passes).
// Throws geofp8::Error on a bad argument, a rendezvous timeout or a transport failure.
std::unique_ptr<Communicator> CreateGlooCommunicator(geofp8::Store& store, int rank, int size,
                                                     const GlooOptions& options = {});

}  // namespace geofp8
