// geofp8-bench collectives: latency of each Communicator collective at a few sizes, across N ranks
// (threads over Gloo TCP on 127.0.0.1, or one process per rank for bench/netem.sh --command
// collectives). Every call is timed on its own, back to back as an exchange issues them; rank 0
// prints the median and 90th percentile and the bytes it moved per second.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "bench/ranks.h"
#include "bench/registry.h"
#include "kernels/common/check.h"
#include "kernels/exchange/gloo_communicator.h"
#include "kernels/exchange/store.h"

namespace geofp8::bench {
namespace {

constexpr const char* kProg = "geofp8-bench collectives";
constexpr const char* kOps = "allgatherv,alltoallv,allreduce,max_reduce_words,barrier";

struct Args {
  int ranks = 4;
  std::vector<size_t> sizes = {64, 4096, 262144, 4194304};
  std::vector<std::string> ops;
  int iters = 50;
  int warmup = 5;
  int loop_nice = 0;  // GlooOptions::loop_nice
  double timeout_s = 300;
  ProcessMode process{-1, "", "127.0.0.1", "collectives"};
};

[[noreturn]] void Usage(const std::string& field, const std::string& problem,
                        const std::string& value) {
  UsageError(kProg, field, problem, value);
}

std::vector<std::string> SplitList(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = std::min(s.find(',', start), s.size());
    if (comma > start) out.push_back(s.substr(start, comma - start));
    start = comma + 1;
  }
  return out;
}

Args ParseArgs(int argc, char** argv) {
  Args a;
  std::string ops = kOps;
  CLI::App app{"latency of each Gloo collective at a few sizes (median, p90)", "collectives"};
  app.add_option("--ranks", a.ranks, "ranks")->capture_default_str()->check(CLI::Range(1, 4096));
  app.add_option("--sizes", a.sizes,
                 "bytes each rank contributes (allgatherv: its block; alltoallv: the sum of its "
                 "blocks to every rank; allreduce: the fp32 buffer); max_reduce_words always "
                 "moves 16 words, barrier nothing")
      ->delimiter(',')
      ->capture_default_str()
      ->check(CLI::Range(size_t{1}, size_t{1} << 32));
  app.add_option("--ops", ops, "comma list of collectives")->capture_default_str();
  app.add_option("--iters", a.iters, "timed calls per size")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  app.add_option("--warmup", a.warmup, "untimed calls first")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000000));
  app.add_option("--loop-nice", a.loop_nice, "niceness added to Gloo's event-loop thread")
      ->capture_default_str()
      ->check(CLI::Range(0, 19));
  app.add_option("--timeout-s", a.timeout_s, "collective timeout")
      ->capture_default_str()
      ->check(CLI::Range(1.0, 86400.0));
  AddProcessModeFlags(app, a.process);
  if (int rc = ParseFlags(app, argc, argv); rc >= 0) std::exit(rc);
  a.ops = SplitList(ops);
  if (a.ops.empty()) Usage("--ops", "empty list", ops);
  const auto known = SplitList(kOps);
  for (const auto& op : a.ops) {
    if (std::find(known.begin(), known.end(), op) == known.end()) {
      Usage("--ops", std::string("unknown collective, accepted: ") + kOps, op);
    }
  }
  if (a.process.rank >= a.ranks)
    Usage("--rank", "must be < --ranks", std::to_string(a.process.rank));
  if (a.process.rank >= 0 && a.process.store_dir.empty())
    Usage("--store-dir", "required with --rank", "empty");
  return a;
}

struct Row {
  std::string op;
  size_t bytes = 0;
  double median_us = 0, p90_us = 0;
};

std::vector<Row> RunRank(Communicator& comm, const Args& a) {
  const int n = comm.size();
  const int r = comm.rank();
  std::vector<Row> rows;
  for (const std::string& op : a.ops) {
    const bool sized = op != "max_reduce_words" && op != "barrier";
    for (size_t bytes : sized ? a.sizes : std::vector<size_t>{Communicator::kMaxReduceWords * 8}) {
      if (op == "barrier") bytes = 0;
      std::function<void()> call;
      std::vector<uint8_t> send, recv;
      std::vector<size_t> counts(n);
      std::vector<float> floats;
      std::vector<uint64_t> words(Communicator::kMaxReduceWords, static_cast<uint64_t>(r));
      if (op == "allgatherv") {
        send.assign(bytes, static_cast<uint8_t>(r));
        recv.resize(bytes * n);
        std::fill(counts.begin(), counts.end(), bytes);
        call = [&] { comm.AllGatherV(send, recv, counts); };
      } else if (op == "alltoallv") {
        for (int j = 0; j < n; ++j) counts[j] = bytes / n + (static_cast<size_t>(j) < bytes % n);
        send.assign(bytes, static_cast<uint8_t>(r));
        // Rank i sends rank r the block counts_i[r]; with every rank's counts alike, that is ours.
        std::vector<size_t> recv_counts(n, counts[r]);
        recv.resize(counts[r] * n);
        call = [&, recv_counts] { comm.AllToAllV(send, counts, recv, recv_counts); };
      } else if (op == "allreduce") {
        floats.assign((bytes + 3) / 4, 1.f);
        bytes = floats.size() * 4;
        call = [&] { comm.AllReduceSum(floats); };
      } else if (op == "max_reduce_words") {
        call = [&] { comm.MaxReduceWords(words); };
      } else {
        call = [&] { comm.Barrier(); };
      }
      std::vector<double> us;
      comm.Barrier();
      for (int it = 0; it < a.warmup + a.iters; ++it) {
        const auto t0 = std::chrono::steady_clock::now();
        call();
        const double t =
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                .count();
        if (it >= a.warmup) us.push_back(t);
      }
      std::sort(us.begin(), us.end());
      rows.push_back(
          {op, bytes, us[us.size() / 2], us[std::min(us.size() - 1, us.size() * 9 / 10)]});
    }
  }
  return rows;
}

void Print(const Args& a, const std::vector<Row>& rows, bool processes) {
  std::printf(
      "collectives: %d ranks (%s, gloo tcp, loop nice +%d), %d calls each after %d "
      "warm-up, rank 0's times\n",
      a.ranks, processes ? "processes" : "threads", a.loop_nice, a.iters, a.warmup);
  std::printf("%-18s %10s %12s %12s %12s\n", "collective", "bytes", "median_us", "p90_us", "MB/s");
  for (const Row& r : rows) {
    std::printf("%-18s %10zu %12.1f %12.1f %12.1f\n", r.op.c_str(), r.bytes, r.median_us, r.p90_us,
                r.median_us > 0 ? r.bytes / r.median_us : 0.0);
  }
}

int RunCollectivesBench(int argc, char** argv) {
  const Args a = ParseArgs(argc, argv);
  GlooOptions go;
  go.hostname = a.process.hostname;
  go.prefix = a.process.prefix;
  go.loop_nice = a.loop_nice;
  go.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout_s * 1000));
  return RunRanks<Row>(
      kProg, a.ranks, a.process.rank, a.process.store_dir, go,
      [&](Communicator& comm) { return RunRank(comm, a); },
      [&](const std::vector<Row>& rows, bool processes) { Print(a, rows, processes); });
}

}  // namespace

GEOFP8_REGISTER_BENCH("collectives", "latency of each Gloo collective at a few sizes (median, p90)",
                      RunCollectivesBench);

}  // namespace geofp8::bench
