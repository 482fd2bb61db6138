// How multi-rank geofp8-bench subcommands run their ranks: one rank in this process (process
// mode, for bench/netem.sh: ranks rendezvous through a FileStore in a shared folder) or every rank
// as a thread over loopback Gloo (a MemoryStore). Rank 0's rows are printed.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/exchange/gloo_communicator.h"
#include "kernels/exchange/store.h"

namespace geofp8::bench {

// Where a multi-rank subcommand's process mode rendezvouses: rank < 0 runs every rank as a thread.
struct ProcessMode {
  int rank = -1;
  std::string store_dir;
  std::string hostname = "127.0.0.1";
  std::string prefix;
};

// --rank, --store-dir, --hostname and --prefix on `app`, into `mode`.
inline void AddProcessModeFlags(CLI::App& app, ProcessMode& mode) {
  app.add_option("--rank", mode.rank,
                 "process mode: run only rank R; all ranks share --store-dir (a FileStore) and "
                 "listen on --hostname. Without --rank, ranks run as threads.")
      ->check(CLI::Range(0, 4095));
  app.add_option("--store-dir", mode.store_dir, "rendezvous directory (process mode)");
  app.add_option("--hostname", mode.hostname, "address to listen on (process mode)")
      ->capture_default_str();
  app.add_option("--prefix", mode.prefix, "rendezvous key prefix (process mode)")
      ->capture_default_str();
}

// rank >= 0: process mode. `run` gives a rank's rows; `print(rows, processes)` shows rank 0's.
// Returns the exit code: 0, or 1 after printing "prog: error: rank R: ..." for the first rank
// that failed.
template <typename Row>
int RunRanks(const char* prog, int ranks, int rank, const std::string& store_dir,
             const GlooOptions& go, const std::function<std::vector<Row>(Communicator&)>& run,
             const std::function<void(const std::vector<Row>&, bool)>& print) {
  try {
    if (rank >= 0) {
      FileStore store(store_dir);
      auto comm = CreateGlooCommunicator(store, rank, ranks, go);
      const auto rows = run(*comm);
      if (rank == 0) print(rows, true);
      comm->Barrier();
      return 0;
    }
    MemoryStore store;
    std::vector<std::string> errors(ranks);
    std::vector<Row> rows;
    std::vector<std::thread> threads;
    for (int r = 0; r < ranks; ++r) {
      threads.emplace_back([&, r] {
        try {
          auto comm = CreateGlooCommunicator(store, r, ranks, go);
          auto mine = run(*comm);
          if (r == 0) rows = std::move(mine);
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < ranks; ++r) {
      if (!errors[r].empty()) {
        std::fprintf(stderr, "%s: error: rank %d: %s\n", prog, r, errors[r].c_str());
        return 1;
      }
    }
    print(rows, false);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: error: rank %d: %s\n", prog, rank, e.what());
    return 1;
  }
}

}  // namespace geofp8::bench
