// Test helper: runs N ranks as threads, each with its own Gloo communicator over real TCP on
// 127.0.0.1, rendezvousing through one MemoryStore. Collects each rank's error message.
#pragma once

#include <atomic>
#include <functional>
#include <latch>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kernels/common/check.h"
#include "kernels/exchange/gloo_communicator.h"
#include "kernels/exchange/store.h"

namespace geofp8::testing {

// Returns one entry per rank: "" on success, else the exception's message.
// `channels`: GlooOptions::channels (2: with a side channel).
inline std::vector<std::string> RunRanks(
    int n, const std::function<void(Communicator&)>& body,
    std::chrono::milliseconds timeout = std::chrono::milliseconds(60000), int channels = 2) {
  static std::atomic<int> group{0};
  MemoryStore store;
  const std::string prefix = "test" + std::to_string(group++);
  std::vector<std::string> errors(n);
  // Every rank has made its communicator, or failed to: none closes its own before then, since a
  // peer still connecting to a closed one fails with "connection reset by peer" (a body that
  // throws before any collective returns at once).
  std::latch connected(n);
  struct AfterAllConnected {
    std::latch& l;
    ~AfterAllConnected() { l.wait(); }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      bool counted = false;
      try {
        GlooOptions options;
        options.prefix = prefix;
        options.timeout = timeout;
        options.channels = channels;
        auto comm = CreateGlooCommunicator(store, r, n, options);
        connected.count_down();
        counted = true;
        AfterAllConnected wait{connected};  // destroyed before comm
        body(*comm);
      } catch (const std::exception& e) {
        if (!counted) connected.count_down();
        errors[r] = e.what();
        if (errors[r].empty()) errors[r] = "(empty error message)";
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

inline std::string JoinErrors(const std::vector<std::string>& errors) {
  std::string out;
  for (size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r].empty()) out += "rank " + std::to_string(r) + ": " + errors[r] + "\n";
  }
  return out;
}

}  // namespace geofp8::testing
