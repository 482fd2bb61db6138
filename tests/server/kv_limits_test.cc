// Rendezvous KV edge values: an Add that would wrap int64 and a wait of 2^63-1 ms, which used to
// overflow the deadline into the past.
#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <limits>
#include <thread>

#include "server/coordinator/kv.h"

namespace geofp8 {
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

}  // namespace
}  // namespace geofp8
