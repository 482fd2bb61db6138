// DueVersion and StartVersion (platform/policy/policy.h), the rule the built-in trainer and the
// Python hook share for when a policy version takes effect: effective, agreed, taken, replaying.
#include <gtest/gtest.h>

#include <map>
#include <optional>

#include "platform/policy/policy.h"

namespace geofp8 {
namespace {

// A version: effective from `effective`; taken at `taken` when >= 0, untaken otherwise.
v1::Policy Version(uint64_t v, int64_t effective, int64_t taken = -1) {
  v1::Policy p;
  p.set_job_id("job-000001");
  p.set_version(v);
  p.set_effective_step(effective);
  if (taken >= 0) p.set_taken_step(taken);
  return p;
}

using Versions = std::map<uint64_t, v1::Policy>;

Versions Of(std::initializer_list<v1::Policy> list) {
  Versions out;
  for (const auto& p : list) out.emplace(p.version(), p);
  return out;
}

// The version number, 0 for none: readable failures.
uint64_t Num(const std::optional<v1::Policy>& p) { return p ? p->version() : 0; }

TEST(DueVersion, AnAgreedVersionAppliesExactlyAtItsEffectiveStep) {
  const Versions vs = Of({Version(1, 0, 0), Version(2, 10)});
  EXPECT_EQ(Num(DueVersion(vs, 1, 9, 2)), 0u) << "one step early";
  EXPECT_EQ(Num(DueVersion(vs, 1, 10, 2)), 2u) << "at its effective step, not one step late";
  // The effective step is a lower bound: a version every rank holds only later applies then.
  EXPECT_EQ(Num(DueVersion(vs, 1, 17, 2)), 2u);
  EXPECT_EQ(Num(DueVersion(vs, 2, 17, 2)), 0u) << "already in force";
}

TEST(DueVersion, AVersionNotEveryRankHoldsWaits) {
  const Versions vs = Of({Version(1, 0, 0), Version(2, 10), Version(3, 12)});
  EXPECT_EQ(Num(DueVersion(vs, 1, 15, 1)), 0u) << "agreed is v1: nobody holds v2 everywhere";
  EXPECT_EQ(Num(DueVersion(vs, 1, 15, 2)), 2u) << "v3 is effective but not held by every rank";
  EXPECT_EQ(Num(DueVersion(vs, 1, 15, 3)), 3u) << "the newest due version, skipping v2";
  EXPECT_EQ(Num(DueVersion(vs, 1, 11, 3)), 2u) << "v3 not effective yet";
}

TEST(DueVersion, ATakenVersionAppliesAtItsTakenStepWhateverAgreedSays) {
  // A resumed attempt replays: v2 was effective from step 10 but taken at 15.
  const Versions vs = Of({Version(1, 0, 0), Version(2, 10, 15)});
  EXPECT_EQ(Num(DueVersion(vs, 1, 10, 2)), 0u) << "effective, but it was taken later";
  EXPECT_EQ(Num(DueVersion(vs, 1, 14, 2)), 0u);
  EXPECT_EQ(Num(DueVersion(vs, 1, 15, 1)), 2u) << "taken: no agreement needed";
  EXPECT_EQ(Num(DueVersion(vs, 2, 16, 2)), 0u);
}

TEST(DueVersion, WhileReplayingNoUntakenVersionApplies) {
  // v2 taken at 15, v3 taken at 20, v4 never taken (it arrived after the attempt died).
  const Versions vs =
      Of({Version(1, 0, 0), Version(2, 10, 15), Version(3, 12, 20), Version(4, 13)});
  EXPECT_EQ(Num(DueVersion(vs, 1, 14, 4)), 0u) << "v4 is effective and agreed, but v2 is pending";
  EXPECT_EQ(Num(DueVersion(vs, 1, 15, 4)), 2u);
  EXPECT_EQ(Num(DueVersion(vs, 2, 19, 4)), 0u) << "v3 still to replay";
  EXPECT_EQ(Num(DueVersion(vs, 2, 20, 4)), 4u) << "replay done: the agreed untaken one applies";
  EXPECT_EQ(Num(DueVersion(vs, 2, 20, 3)), 3u) << "v4 not held everywhere: v3 at its taken step";
  EXPECT_EQ(Num(DueVersion(vs, 3, 21, 3)), 0u);
  EXPECT_EQ(Num(DueVersion(vs, 3, 21, 4)), 4u);
}

TEST(DueVersion, AnUntakenVersionOlderThanATakenOneWasOvertaken) {
  // v2 was never taken (v3 overtook it): once v3 is replayed at 15, v2 is never due.
  const Versions vs = Of({Version(1, 0, 0), Version(2, 5), Version(3, 8, 15)});
  EXPECT_EQ(Num(DueVersion(vs, 1, 12, 3)), 0u);
  EXPECT_EQ(Num(DueVersion(vs, 1, 15, 3)), 3u);
  EXPECT_EQ(Num(DueVersion(vs, 3, 16, 3)), 0u);
}

TEST(DueVersion, NothingDueWithoutNewerVersions) {
  EXPECT_EQ(Num(DueVersion({}, 0, 5, 0)), 0u);
  EXPECT_EQ(Num(DueVersion(Of({Version(1, 0, 0)}), 1, 5, 1)), 0u);
}

TEST(StartVersion, TheNewestTakenAtOrBeforeTheStart) {
  const Versions vs = Of({Version(1, 0, 0), Version(2, 10, 15), Version(3, 25, 30)});
  EXPECT_EQ(Num(StartVersion(vs, 0)), 1u);
  EXPECT_EQ(Num(StartVersion(vs, 14)), 1u);
  EXPECT_EQ(Num(StartVersion(vs, 15)), 2u);
  EXPECT_EQ(Num(StartVersion(vs, 29)), 2u) << "v3 was effective at 25 but taken at 30";
  EXPECT_EQ(Num(StartVersion(vs, 30)), 3u);
  EXPECT_EQ(Num(StartVersion(vs, 1000)), 3u);
}

TEST(StartVersion, UntakenVersionsAreNotInForceAtTheStart) {
  // v2 was overtaken by v3; v4 is not taken yet: neither was in force at any step.
  const Versions vs = Of({Version(1, 0, 0), Version(2, 5), Version(3, 6, 9), Version(4, 12)});
  EXPECT_EQ(Num(StartVersion(vs, 7)), 1u);
  EXPECT_EQ(Num(StartVersion(vs, 9)), 3u);
  EXPECT_EQ(Num(StartVersion(vs, 20)), 3u);
}

TEST(StartVersion, WithoutTakenStepsTheNewestEffective) {
  // Versions from an older coordinator, which recorded no taken steps.
  const Versions vs = Of({Version(1, 0), Version(2, 10), Version(3, 20)});
  EXPECT_EQ(Num(StartVersion(vs, 0)), 1u);
  EXPECT_EQ(Num(StartVersion(vs, 9)), 1u);
  EXPECT_EQ(Num(StartVersion(vs, 10)), 2u);
  EXPECT_EQ(Num(StartVersion(vs, 20)), 3u);
  EXPECT_EQ(Num(StartVersion({}, 5)), 0u);
}

TEST(StartVersion, AVersionWithATakenStepNeverFollowsTheLegacyRule) {
  // v1 from an older coordinator (no taken step); v2 made after the upgrade, effective from 10
  // and taken at 15. A resume at 12 lies between its effective and its taken step: the steps
  // from 12 to 14 first ran under v1, so the resumed attempt must start there too.
  const Versions vs = Of({Version(1, 0), Version(2, 10, 15)});
  EXPECT_EQ(Num(StartVersion(vs, 12)), 1u);
  EXPECT_EQ(Num(StartVersion(vs, 14)), 1u);
  EXPECT_EQ(Num(StartVersion(vs, 15)), 2u);
}

}  // namespace
}  // namespace geofp8
