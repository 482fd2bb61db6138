// Gloo communicator over real TCP on 127.0.0.1 with ranks as threads: every collective against
// values each rank can predict exactly, world sizes 1..8, empty parts, timeouts and broken peers.
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <thread>

#include "kernels/exchange/bf16.h"
#include "tests/exchange/rank_threads.h"

namespace geofp8 {
namespace {

using std::chrono::milliseconds;
using testing::JoinErrors;
using testing::RunRanks;

// Bytes rank `from` sends to rank `to`: varies per pair, zero for some pairs.
size_t PairBytes(int from, int to) { return static_cast<size_t>((from * 7 + to * 3) % 5) * 3; }
uint8_t PairByte(int from, int to, size_t i) {
  return static_cast<uint8_t>(from * 31 + to * 17 + i);
}

class CommSweep : public ::testing::TestWithParam<int> {};

TEST_P(CommSweep, EveryCollective) {
  const int n = GetParam();
  const auto errors = RunRanks(n, [n](Communicator& comm) {
    const int r = comm.rank();
    ASSERT_EQ(comm.size(), n);

    // All-to-all-v with uneven and empty parts.
    std::vector<size_t> send_counts(n), recv_counts(n);
    std::vector<uint8_t> send;
    for (int j = 0; j < n; ++j) {
      send_counts[j] = PairBytes(r, j);
      recv_counts[j] = PairBytes(j, r);
      for (size_t i = 0; i < send_counts[j]; ++i) send.push_back(PairByte(r, j, i));
    }
    std::vector<uint8_t> recv(std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0}));
    comm.AllToAllV(send, send_counts, recv, recv_counts);
    size_t off = 0;
    for (int i = 0; i < n; ++i) {
      for (size_t k = 0; k < recv_counts[i]; ++k) ASSERT_EQ(recv[off + k], PairByte(i, r, k));
      off += recv_counts[i];
    }

    // All-gather-v: rank i contributes i*5 bytes (rank 0 nothing).
    std::vector<size_t> counts(n);
    for (int i = 0; i < n; ++i) counts[i] = static_cast<size_t>(i) * 5;
    std::vector<uint8_t> mine(counts[r]);
    for (size_t k = 0; k < mine.size(); ++k) mine[k] = PairByte(r, 0, k);
    std::vector<uint8_t> all(std::accumulate(counts.begin(), counts.end(), size_t{0}));
    comm.AllGatherV(mine, all, counts);
    off = 0;
    for (int i = 0; i < n; ++i) {
      for (size_t k = 0; k < counts[i]; ++k) ASSERT_EQ(all[off + k], PairByte(i, 0, k));
      off += counts[i];
    }

    // Sums of small integers are exact in fp32 and bf16, whatever the reduction order.
    for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{3000}}) {
      std::vector<float> f(count);
      std::vector<uint16_t> h(count);
      for (size_t k = 0; k < count; ++k) {
        f[k] = static_cast<float>((r + 1) * (k % 13));
        h[k] = FloatToBf16(static_cast<float>(r + 1));
      }
      comm.AllReduceSum(f);
      comm.AllReduceSumBf16(h);
      for (size_t k = 0; k < count; ++k) {
        ASSERT_EQ(f[k], static_cast<float>(n * (n + 1) / 2 * (k % 13)));
        ASSERT_EQ(Bf16ToFloat(h[k]), static_cast<float>(n * (n + 1) / 2));
      }
    }

    // Broadcast from the last rank.
    std::vector<uint8_t> b(11, static_cast<uint8_t>(r));
    comm.Broadcast(b, n - 1);
    for (uint8_t v : b) ASSERT_EQ(v, n - 1);

    EXPECT_EQ(comm.MaxReduce(r == n / 2 ? 9u : static_cast<uint32_t>(r % 2)), 9u);
    EXPECT_EQ(comm.MaxReduce(0u), 0u);

    // Word-wise maximum, through the backend's override and through the base class's gather, of
    // words that peak on different ranks (and 0 and ~0 words), against the maximum computed here.
    auto word = [](int rank, size_t i) -> uint64_t {
      if (i == 0) return 0;
      if (i == 1) return ~uint64_t{0};
      return (uint64_t{0x9e3779b97f4a7c15} * (rank + 1) * (i + 3)) ^
             (static_cast<uint64_t>(rank) << 60);
    };
    for (size_t count : {size_t{1}, size_t{10}, Communicator::kMaxReduceWords}) {
      std::vector<uint64_t> want(count, 0);
      for (int q = 0; q < n; ++q) {
        for (size_t i = 0; i < count; ++i) want[i] = std::max(want[i], word(q, i));
      }
      std::vector<uint64_t> fast(count), slow(count);
      for (size_t i = 0; i < count; ++i) fast[i] = slow[i] = word(r, i);
      comm.MaxReduceWords(fast);
      comm.Communicator::MaxReduceWords(slow);
      ASSERT_EQ(fast, want) << count;
      ASSERT_EQ(slow, want) << count;
    }
    std::vector<uint64_t> too_many(Communicator::kMaxReduceWords + 1);
    EXPECT_THROW(comm.MaxReduceWords(too_many), Error);

    // Bounded exchange: rank r sends PairBytes(r, j) + 1 bytes to j, which posts a receive 8
    // bytes larger (a shorter message is accepted) and finds the bytes at the front; the bytes
    // counted are those actually sent. The slack of the receive is left as it was.
    ASSERT_TRUE(comm.SupportsBoundedReceive());
    std::vector<std::vector<uint8_t>> out(n), in(n);
    std::vector<std::span<const uint8_t>> send_to(n);
    std::vector<std::span<uint8_t>> recv_from(n);
    uint64_t sent = 0;
    for (int j = 0; j < n; ++j) {
      for (size_t k = 0; k < PairBytes(r, j) + 1; ++k) out[j].push_back(PairByte(r, j, k));
      in[j].assign(PairBytes(j, r) + 1 + 8, 0xee);
      send_to[j] = out[j];
      recv_from[j] = in[j];
      if (j != r) sent += out[j].size();
    }
    const uint64_t bytes_before = comm.stats().bytes_sent;
    comm.ExchangeBounded(send_to, recv_from);
    EXPECT_EQ(comm.stats().bytes_sent - bytes_before, sent);
    for (int j = 0; j < n; ++j) {
      if (j == r) continue;
      const size_t len = PairBytes(j, r) + 1;
      for (size_t k = 0; k < len; ++k) ASSERT_EQ(in[j][k], PairByte(j, r, k)) << j << " " << k;
      for (size_t k = len; k < in[j].size(); ++k) ASSERT_EQ(in[j][k], 0xee) << j << " " << k;
    }
    comm.Barrier();
    EXPECT_GT(comm.stats().collectives, 0u);
  });
  EXPECT_EQ(JoinErrors(errors), "");
}

INSTANTIATE_TEST_SUITE_P(Ranks, CommSweep, ::testing::Values(1, 2, 3, 4, 8));

// The side channel runs collectives of its own while the main channel is busy on another thread:
// both streams, interleaved differently on every rank by scheduling, stay correct and counted.
class SideChannel : public ::testing::TestWithParam<int> {};

TEST_P(SideChannel, ConcurrentCollectivesOnBothChannels) {
  const int n = GetParam();
  constexpr int kRounds = 40;
  const auto errors = RunRanks(n, [n](Communicator& comm) {
    const int r = comm.rank();
    Communicator* side = comm.side_channel();
    ASSERT_NE(side, nullptr);
    ASSERT_EQ(side->rank(), r);
    ASSERT_EQ(side->size(), n);
    const uint64_t before = comm.stats().collectives;
    std::string side_error;
    std::thread gathers([&] {
      try {
        for (int round = 0; round < kRounds; ++round) {
          std::vector<size_t> counts(n);
          for (int i = 0; i < n; ++i) counts[i] = static_cast<size_t>((i + round) % 4) * 1000;
          std::vector<uint8_t> mine(counts[r]);
          for (size_t k = 0; k < mine.size(); ++k) mine[k] = PairByte(r, round, k);
          std::vector<uint8_t> all(std::accumulate(counts.begin(), counts.end(), size_t{0}));
          side->AllGatherV(mine, all, counts);
          size_t off = 0;
          for (int i = 0; i < n; ++i) {
            for (size_t k = 0; k < counts[i]; ++k) {
              if (all[off + k] != PairByte(i, round, k))
                GEOFP8_FAIL("side round ", round, " wrong");
            }
            off += counts[i];
          }
        }
      } catch (const std::exception& e) {
        side_error = e.what();
      }
    });
    for (int round = 0; round < kRounds; ++round) {
      std::vector<size_t> send_counts(n), recv_counts(n);
      std::vector<uint8_t> send;
      for (int j = 0; j < n; ++j) {
        send_counts[j] = PairBytes(r, j) * 300;
        recv_counts[j] = PairBytes(j, r) * 300;
        for (size_t i = 0; i < send_counts[j]; ++i) send.push_back(PairByte(r, j + round, i));
      }
      std::vector<uint8_t> recv(std::accumulate(recv_counts.begin(), recv_counts.end(), size_t{0}));
      comm.AllToAllV(send, send_counts, recv, recv_counts);
      size_t off = 0;
      for (int i = 0; i < n; ++i) {
        for (size_t k = 0; k < recv_counts[i]; ++k)
          ASSERT_EQ(recv[off + k], PairByte(i, r + round, k));
        off += recv_counts[i];
      }
    }
    gathers.join();
    EXPECT_EQ(side_error, "");
    // Both channels count into the main communicator's stats.
    EXPECT_EQ(comm.stats().collectives - before, 2u * kRounds);
  });
  EXPECT_EQ(JoinErrors(errors), "");
}

INSTANTIATE_TEST_SUITE_P(Ranks, SideChannel, ::testing::Values(1, 2, 4, 8));

TEST(GlooCommunicator, OneChannelHasNoSideChannel) {
  MemoryStore store;
  GlooOptions options;
  options.channels = 1;
  EXPECT_EQ(CreateGlooCommunicator(store, 0, 1, options)->side_channel(), nullptr);
  options.channels = 3;
  try {
    CreateGlooCommunicator(store, 0, 1, options);
    FAIL() << "channels 3 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("channels must be 1 or 2 (3)"), std::string::npos)
        << e.what();
  }
}

// Threads of this process at niceness 19 (field 19 of /proc/self/task/TID/stat).
int ThreadsAtNice19() {
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream in(entry.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    std::istringstream fields(stat.substr(stat.rfind(')') + 2));  // after "pid (comm) "
    std::string field;
    for (int i = 3; i <= 19 && fields >> field; ++i) {
    }
    count += field == "19";
  }
  return count;
}

// The event loop runs at the lowered priority (the calling thread does not), the communicator
// works, and out of range is refused.
TEST(GlooCommunicator, LoopNice) {
  MemoryStore store;
  GlooOptions options;
  options.loop_nice = 19;
  const int before = ThreadsAtNice19();
  const int mine = getpriority(PRIO_PROCESS, gettid());
  auto comm = CreateGlooCommunicator(store, 0, 1, options);
  EXPECT_EQ(ThreadsAtNice19(), before + 1);  // the event loop
  EXPECT_EQ(getpriority(PRIO_PROCESS, gettid()), mine);
  std::vector<float> x(3, 1.f);
  comm->AllReduceSum(x);
  EXPECT_EQ(x[0], 1.f);
  options.loop_nice = 20;
  try {
    CreateGlooCommunicator(store, 0, 1, options);
    FAIL() << "loop_nice 20 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("loop_nice must be in [0, 19] (20)"), std::string::npos)
        << e.what();
  }
}

TEST(GlooCommunicator, CollectiveTimeoutFailsInsteadOfHanging) {
  const auto start = std::chrono::steady_clock::now();
  const auto errors = RunRanks(2, [](Communicator& comm) {
    comm.Barrier();
    if (comm.rank() == 0) {
      comm.set_timeout(milliseconds(300));
      std::vector<float> x(100, 1.f);
      comm.AllReduceSum(x);  // rank 1 never joins
    } else {
      std::this_thread::sleep_for(milliseconds(1500));
    }
  });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_NE(errors[0], "");
  EXPECT_NE(errors[0].find("allreduce fp32"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("rank 0"), std::string::npos) << errors[0];
  EXPECT_EQ(errors[1], "");
  EXPECT_LT(seconds, 20.0);
}

TEST(GlooCommunicator, BrokenCommunicatorRefusesLaterCalls) {
  const auto errors = RunRanks(2, [](Communicator& comm) {
    comm.Barrier();
    if (comm.rank() == 0) {
      comm.set_timeout(milliseconds(200));
      try {
        comm.Barrier();
      } catch (const Error&) {
      }
      comm.Barrier();  // must throw "broken", not hang
    } else {
      std::this_thread::sleep_for(milliseconds(1000));
    }
  });
  EXPECT_NE(errors[0].find("broken"), std::string::npos) << errors[0];
}

// A peer that hangs (SIGSTOP, partition) holds a collective until its timeout; Abort() from
// another thread ends it at once, on both channels, and the peer sees the connections close.
TEST(GlooCommunicator, AbortFromAnotherThreadEndsCollectivesOnBothChannels) {
  using Clock = std::chrono::steady_clock;
  std::atomic<bool> rank0_done{false};
  std::atomic<double> rank0_seconds{0}, rank1_seconds{0};
  std::string side_error, later_error;
  const auto errors = RunRanks(
      2,
      [&](Communicator& comm) {
        comm.Barrier();
        if (comm.rank() == 1) {
          // Joins nothing until rank 0 gave up, then finds the connections closed.
          while (!rank0_done.load()) std::this_thread::sleep_for(milliseconds(10));
          const auto t0 = Clock::now();
          try {
            comm.Barrier();
          } catch (const Error&) {
            rank1_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
            throw;
          }
          return;
        }
        ASSERT_NE(comm.side_channel(), nullptr);
        std::thread side([&] {
          try {
            std::vector<float> y(1000, 1.f);
            comm.side_channel()->AllReduceSum(y);
          } catch (const Error& e) {
            side_error = e.what();
          }
        });
        std::thread stopper([&] {
          std::this_thread::sleep_for(milliseconds(300));
          EXPECT_TRUE(comm.Abort("stop from the coordinator"));
        });
        const auto t0 = Clock::now();
        try {
          std::vector<float> x(1000, 1.f);
          comm.AllReduceSum(x);
        } catch (const Error&) {
          rank0_seconds = std::chrono::duration<double>(Clock::now() - t0).count();
          side.join();
          stopper.join();
          try {
            comm.Barrier();
          } catch (const Error& e) {
            later_error = e.what();
          }
          rank0_done = true;
          throw;
        }
        side.join();
        stopper.join();
        rank0_done = true;
      },
      milliseconds(60000));
  EXPECT_NE(errors[0].find("allreduce fp32"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("stop from the coordinator"), std::string::npos) << errors[0];
  EXPECT_NE(side_error.find("stop from the coordinator"), std::string::npos) << side_error;
  EXPECT_NE(later_error.find("aborted (stop from the coordinator)"), std::string::npos)
      << later_error;
  EXPECT_NE(errors[1], "") << "rank 1's barrier succeeded against an aborted rank";
  // Against the 60 s collective timeout: both ranks are out within seconds even on a loaded
  // machine (the abort fires after 0.3 s).
  EXPECT_LT(rank0_seconds.load(), 10.0);
  EXPECT_LT(rank1_seconds.load(), 10.0) << errors[1];
}

TEST(GlooCommunicator, RendezvousTimeoutNamesMissingRank) {
  MemoryStore store;
  GlooOptions options;
  options.timeout = milliseconds(300);
  try {
    CreateGlooCommunicator(store, 0, 2, options);  // rank 1 never shows up
    FAIL() << "rendezvous did not time out";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
  }
}

TEST(GlooCommunicator, RejectsBadRank) {
  MemoryStore store;
  EXPECT_THROW(CreateGlooCommunicator(store, 2, 2), Error);
  EXPECT_THROW(CreateGlooCommunicator(store, 0, 0), Error);
}

}  // namespace
}  // namespace geofp8
