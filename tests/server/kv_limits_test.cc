// Rendezvous KV limits: an Add that would wrap int64, a wait of 2^63-1 ms (which used to overflow
// the deadline into the past), per-job bounds at their limit and one past it, and admission of
// live jobs only.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <limits>
#include <thread>

#include "server/coordinator/kv.h"

namespace geofp8::coordinator {
namespace {

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
constexpr int64_t kMin = std::numeric_limits<int64_t>::min();

TEST(KvLimits, AddThatWouldWrapIsOutOfRangeAndStoresNothing) {
  RendezvousKv kv;
  ASSERT_EQ(*kv.Add("j", "n", kMax), kMax);
  auto r = kv.Add("j", "n", 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(r.status().message(), "key n: adding 1 to 9223372036854775807 overflows int64");
  EXPECT_EQ(*kv.Get("j", "n", 0), "9223372036854775807");
  ASSERT_EQ(*kv.Add("j", "m", kMin), kMin);
  EXPECT_EQ(kv.Add("j", "m", -1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(*kv.Add("j", "m", kMax), -1);
}

TEST(KvLimits, LongestWaitDoesNotExpireAtOnce) {
  RendezvousKv kv;
  auto waiter = std::async(std::launch::async, [&] { return kv.Wait("j", {"k"}, kMax); });
  auto getter = std::async(std::launch::async, [&] { return kv.Get("j", "k", kMax); });
  // Both still wait (a wrapped deadline returned DEADLINE_EXCEEDED at once).
  EXPECT_EQ(waiter.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  EXPECT_EQ(getter.wait_for(std::chrono::milliseconds(0)), std::future_status::timeout);
  ASSERT_TRUE(kv.Set("j", "k", "v").ok());
  EXPECT_TRUE(waiter.get().ok());
  EXPECT_EQ(*getter.get(), "v");
}

// Each bound holds at its limit and refuses one past it, naming the bound and the size.
TEST(KvLimits, PerJobBoundsHoldAndAreNamed) {
  KvLimits limits;
  limits.max_key_bytes = 8;
  limits.max_value_bytes = 16;
  limits.max_keys_per_job = 3;
  limits.max_bytes_per_job = 40;
  RendezvousKv kv(limits);
  EXPECT_TRUE(kv.Set("k", "12345678", "").ok());
  auto s = kv.Set("k", "123456789", "v");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "key: longer than 8 bytes (9)");
  EXPECT_TRUE(kv.Set("v", "k", std::string(16, 'x')).ok());
  s = kv.Set("v", "k", std::string(17, 'x'));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "value: longer than 16 bytes (17 for key k)");
  EXPECT_EQ(*kv.Get("v", "k", 0), std::string(16, 'x')) << "a refused Set changes nothing";
  kv.Clear("k");
  kv.Clear("v");

  ASSERT_TRUE(kv.Set("j", "a", std::string(16, 'x')).ok());  // 17 bytes
  ASSERT_TRUE(kv.Set("j", "b", std::string(16, 'x')).ok());  // 34 bytes
  s = kv.Set("j", "c", std::string(16, 'x'));                // would be 51
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "job j: rendezvous would hold more than 40 bytes (51 with key c)");
  ASSERT_TRUE(kv.Set("j", "c", std::string(5, 'x')).ok());  // 40 bytes: the bound
  s = kv.Set("j", "c", std::string(6, 'x'));                // a replaced value: 41
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "job j: rendezvous would hold more than 40 bytes (41 with key c)");
  ASSERT_TRUE(kv.Set("j", "b", "").ok());  // replacing a value gives its bytes back: 24
  // 3 keys, the bound: a 4th is refused.
  s = kv.Set("j", "d", "1");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(), "job j: rendezvous would hold more than 3 keys (4 with key d)");
  EXPECT_EQ(kv.Add("j", "e", 1).status().code(), absl::StatusCode::kResourceExhausted);
  ASSERT_TRUE(kv.Set("j", "c", "1").ok()) << "a key held may still be replaced";
  // Another job has its own budget; clearing gives the job's back.
  EXPECT_TRUE(kv.Set("other", "d", "1").ok());
  kv.Clear("j");
  EXPECT_TRUE(kv.Set("j", "d", "1").ok());
  EXPECT_EQ(kv.KeyCount(), 2u);
}

// The defaults are the bounds docs/job-spec.md ("Rendezvous") and docs/api-limits.md (`*.key`,
// `KvSetRequest.value`) give, and each holds at its limit and refuses one past it.
TEST(KvLimits, TheDocumentedDefaultsHoldAtTheLimitAndOnePast) {
  const KvLimits limits;
  EXPECT_EQ(limits.max_key_bytes, 1024u);
  EXPECT_EQ(limits.max_value_bytes, 1048576u);
  EXPECT_EQ(limits.max_keys_per_job, 65536u);
  EXPECT_EQ(limits.max_bytes_per_job, 67108864u);
  RendezvousKv kv;

  EXPECT_TRUE(kv.Set("k", std::string(1024, 'k'), "").ok());
  auto s = kv.Set("k", std::string(1025, 'k'), "");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "key: longer than 1024 bytes (1025)");
  EXPECT_TRUE(kv.Set("v", "k", std::string(1048576, 'v')).ok());
  s = kv.Set("v", "k", std::string(1048577, 'v'));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "value: longer than 1048576 bytes (1048577 for key k)");

  // 65536 keys, then one more.
  for (int i = 0; i < 65536; ++i) ASSERT_TRUE(kv.Set("n", "k" + std::to_string(i), "").ok()) << i;
  s = kv.Set("n", "k65536", "");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "job n: rendezvous would hold more than 65536 keys (65537 with key k65536)");

  // 64 MiB of keys and values exactly: 63 values of 1 MiB under 3-byte keys, and the rest.
  size_t held = 0;
  for (int i = 0; i < 63; ++i) {
    const std::string key = "v" + std::string(i < 10 ? "0" : "") + std::to_string(i);
    ASSERT_TRUE(kv.Set("b", key, std::string(1048576, 'v')).ok()) << key;
    held += key.size() + 1048576;
  }
  ASSERT_TRUE(kv.Set("b", "v63", std::string(67108864 - held - 3, 'v')).ok());
  s = kv.Set("b", "z", "");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(s.message(),
            "job b: rendezvous would hold more than 67108864 bytes (67108865 with key z)");
}

TEST(KvLimits, OnlyOpenJobsAreServedAndClearReleasesWaiters) {
  RendezvousKv kv;
  kv.RequireOpenJobs();
  auto s = kv.Set("ghost", "k", "v");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(),
            "job_id: no running attempt of job ghost (unknown, not yet scheduled, or ended)");
  EXPECT_EQ(kv.Wait("ghost", {"k"}, 60000).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(kv.Add("ghost", "k", 1).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(kv.JobCount(), 0u);  // refused calls leave nothing behind

  kv.Open("live");
  ASSERT_TRUE(kv.Set("live", "k", "v").ok());
  auto waiter = std::async(std::launch::async, [&] { return kv.Wait("live", {"never"}, kMax); });
  EXPECT_EQ(waiter.wait_for(std::chrono::milliseconds(100)), std::future_status::timeout);
  kv.Clear("live");  // the attempt ended: its waiter returns now, not at its deadline
  EXPECT_EQ(waiter.get().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(kv.Get("live", "k", 0).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(kv.JobCount(), 0u);
}

TEST(KvLimits, WaitingOnAnUnknownJobCreatesNoEntry) {
  RendezvousKv kv;
  EXPECT_EQ(kv.Wait("nobody", {"k"}, 1).code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(kv.JobCount(), 0u);
}

}  // namespace
}  // namespace geofp8::coordinator
