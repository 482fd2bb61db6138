// Bounded policy history (issue #31 item 4) at the coordinator, with fakes: updates that would
// make a resumed rank's Assignment undeliverable are refused with the bound and the size, the
// Assignment after a rank's death stays under gRPC's limit, and ListPolicyVersions pages. The
// bounds on history bytes and on patches per update and per version hold at their limit and
// refuse one past it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <set>
#include <string>
#include <vector>

#include "platform/policy/policy.h"
#include "server/coordinator/coordinator.h"
#include "tests/server/coordinator_harness.h"

namespace geofp8::coordinator {
namespace {

// gRPC's default limit on a received message, which the workers keep.
constexpr size_t kGrpcReceiveLimit = 4194304;

// The i-th of many distinct globs that each match every block layer of llama-tiny (a pattern
// that matches no layer is refused): "layers.*[.abc]*", 15 bytes.
std::string Glob(int i) {
  std::string code;
  for (int k = 0; k < 3; ++k, i /= 26) code += static_cast<char>('a' + i % 26);
  return "layers.*[." + code + "]*";
}

class PolicyHistoryTest : public CoordinatorHarness {
 protected:
  absl::Status Progress(const Worker& w, int64_t step, uint64_t version) {
    v1::WorkerMessage m;
    m.mutable_progress()->set_step(step);
    m.mutable_progress()->set_policy_version(version);
    return Send(w, m);
  }
  // Rank 0 took `version` at `step` in attempt `attempt`.
  absl::Status Taken(const Worker& w, const std::string& id, uint64_t version, int64_t step,
                     int attempt) {
    v1::WorkerMessage m;
    m.mutable_policy_ack()->set_job_id(id);
    m.mutable_policy_ack()->set_attempt(attempt);
    m.mutable_policy_ack()->set_version(version);
    m.mutable_policy_ack()->set_step(step);
    return Send(w, m);
  }
  absl::Status Checkpoint(const Worker& w, const std::string& id, int64_t step, int attempt) {
    v1::WorkerMessage m;
    m.mutable_checkpoint()->set_job_id(id);
    m.mutable_checkpoint()->set_attempt(attempt);
    m.mutable_checkpoint()->set_step(step);
    return Send(w, m);
  }
  // An update adding `count` new distinct globs, the first being Glob(first).
  absl::StatusOr<v1::UpdatePolicyResponse> AddGlobs(const std::string& id, int first, int count) {
    v1::UpdatePolicyRequest req;
    req.set_job_id(id);
    for (int i = first; i < first + count; ++i) {
      v1::LayerPatch* p = req.add_patches();
      p->set_layer(Glob(i));
      p->set_format(i % 2 ? v1::FORMAT_BF16 : v1::FORMAT_FP8_E4M3);
    }
    return coordinator->UpdatePolicy(req);
  }
  // Every page of the job's history, with page_size `page_size`.
  std::vector<v1::ListPolicyVersionsResponse> Pages(const std::string& id, int page_size) {
    std::vector<v1::ListPolicyVersionsResponse> pages;
    v1::ListPolicyVersionsRequest req;
    req.set_job_id(id);
    req.set_page_size(page_size);
    do {
      auto page = coordinator->ListPolicyVersions(req);
      EXPECT_TRUE(page.ok()) << page.status();
      if (!page.ok() || pages.size() > 10000) break;
      pages.push_back(*page);
      req.set_page_token(page->next_page_token());
    } while (!req.page_token().empty());
    return pages;
  }
};

constexpr const char* kSpec =
    "name: t\nworld_size: 1\nrestarts: {max_restarts: 2}\npolicy: {margin: 1}\n";

// The reproducer: 200 accepted updates of 20 new distinct globs each (4,000 patches by
// v201), every version taken by the ranks and no checkpoint since step 0, so a rank resuming
// there needs all of them: an 8 MB Assignment on which every worker looped. Now the updates
// past the bound are refused, naming it and the size, and the replacement rank's Assignment
// arrives; after a checkpoint the older versions drop out and updates are accepted again.
TEST_F(PolicyHistoryTest, UpdatesPastTheBoundAreRefusedAndTheResumedAssignmentFits) {
  const std::string id = Submit(kSpec);
  Worker a = Join("a");
  ASSERT_EQ(a.sink->Assignments().size(), 1u);
  int64_t step = 0;
  uint64_t in_force = 1;
  ASSERT_TRUE(Progress(a, step, in_force).ok());
  int accepted = 0, refused = 0;
  std::string first_refusal;
  for (int u = 0; u < 200; ++u) {
    auto r = AddGlobs(id, 20 * u, 20);
    if (!r.ok()) {
      ++refused;
      EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
      EXPECT_NE(r.status().message().find("over the bound of 2097152 bytes"), std::string::npos)
          << r.status();
      if (first_refusal.empty()) first_refusal = std::string(r.status().message());
      continue;
    }
    ++accepted;
    // The ranks take each version at its effective step.
    step = r->policy().effective_step();
    ASSERT_TRUE(Taken(a, id, r->policy().version(), step, 0).ok());
    in_force = r->policy().version();
    ASSERT_TRUE(Progress(a, step, in_force).ok());
  }
  ASSERT_GT(refused, 0) << "200 x 20 globs should reach the bound without a checkpoint";
  EXPECT_GT(accepted, 20);
  EXPECT_EQ(Get(id).policy_version(), in_force);
  // The message names the versions, the recovery point, the size and the bound.
  const std::string v = std::to_string(in_force + 1);
  EXPECT_EQ(first_refusal.rfind("policy history: v" + v +
                                    " would bring the policy versions a resumed rank can need "
                                    "(v1 to v" +
                                    v + ", from the recovery point at step 0) to ",
                                0),
            0u)
      << first_refusal;

  // Rank 0 dies with a spare waiting: the spare's Assignment carries every version since step 0
  // and fits.
  Worker b = Join("b");
  clock.now += 1500;
  ASSERT_TRUE(Heartbeat(b).ok());  // b is alive; a is silent past the timeout
  coordinator->Tick();
  const auto assignments = b.sink->Assignments();
  ASSERT_EQ(assignments.size(), 1u);
  const v1::Assignment& asg = assignments[0];
  EXPECT_EQ(asg.attempt(), 1);
  EXPECT_EQ(asg.resume_step(), 0);
  EXPECT_EQ(asg.policy_history_size(), accepted + 1);
  EXPECT_EQ(asg.policy().version(), in_force);
  v1::CoordinatorMessage wire;
  *wire.mutable_assignment() = asg;
  EXPECT_LE(wire.ByteSizeLong(), kMaxAssignmentBytes);
  EXPECT_LT(wire.ByteSizeLong(), kGrpcReceiveLimit);
  EXPECT_EQ(Get(id).state(), v1::JOB_SCHEDULED);

  // The new attempt passes the last taken step and checkpoints: the versions before the one in
  // force there are no longer needed, and updates are accepted again.
  ASSERT_TRUE(Progress(b, step + 5, in_force).ok());
  ASSERT_TRUE(Checkpoint(b, id, step + 5, 1).ok());
  auto again = AddGlobs(id, 20 * 200, 20);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->policy().version(), in_force + 1);
}

// A version carries every patch of its job, so one update of long globs can fill the bound by
// itself: the size check counts bytes, not patches.
TEST_F(PolicyHistoryTest, TheBoundCountsBytesNotPatches) {
  const std::string id = Submit(kSpec);
  Worker a = Join("a");
  v1::UpdatePolicyRequest req;
  req.set_job_id(id);
  for (int i = 0; i < 256; ++i) {
    v1::LayerPatch* p = req.add_patches();
    // 256 distinct 5000-byte globs ("layers.*" and stars) that match every block layer: 1.3 MB,
    // well under the 4096-patch bound. The latest version travels twice (policy and history).
    p->set_layer("layers.*" + std::string(5000 + i, '*'));
    p->set_format(v1::FORMAT_BF16);
  }
  auto r = coordinator->UpdatePolicy(req);
  ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
  EXPECT_NE(r.status().message().find("(v1 to v2, from the recovery point at step 0)"),
            std::string::npos)
      << r.status();
  EXPECT_NE(r.status().message().find("over the bound of 2097152 bytes"), std::string::npos);
  EXPECT_EQ(Get(id).policy_version(), 1u) << "a refused update makes no version";
  req.mutable_patches()->DeleteSubrange(100, 156);  // 0.5 MB, twice: within the bound
  auto fits = coordinator->UpdatePolicy(req);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(fits->policy().version(), 2u);
}

// Bytes of policy versions an Assignment resuming at step 0 carries: every version in
// `policy_history`, and the latest once more in `policy` (each a field of 1-byte tag).
size_t AssignmentPolicyBytes(const std::vector<v1::Policy>& versions) {
  v1::Assignment a;
  *a.mutable_policy() = versions.back();
  for (const auto& p : versions) *a.add_policy_history() = p;
  return a.ByteSizeLong();
}

// The bound holds at its byte and refuses the one past it. Every byte of a new version counts
// twice (as `policy` and in `policy_history`), so one job reaches only even or only odd totals:
// the job with an even v1 + v2 lands on 2097152 exactly (accepted), the other on 2097153
// (refused). The size a glob length gives is read from a refusal's message, then checked
// against the Assignment the versions accepted would make.
TEST_F(PolicyHistoryTest, TheBoundHoldsAtItsByteAndRefusesTheNextOne) {
  constexpr size_t kBound = kMaxPolicyHistoryBytes;
  ASSERT_EQ(kBound, 2097152u) << "docs/job-spec.md gives 2 MiB";
  std::set<size_t> landed;
  for (int k = 0; k < 2; ++k) {
    SCOPED_TRACE("v2 of glob layers.*" + std::string(1 + k, '*'));
    const std::string id = Submit("name: h" + std::to_string(k) + std::string(kSpec).substr(7));
    v1::UpdatePolicyRequest v2;
    v2.set_job_id(id);
    v2.add_patches()->set_layer("layers.*" + std::string(1 + k, '*'));
    v2.mutable_patches(0)->set_format(v1::FORMAT_FP8_E4M3);
    ASSERT_TRUE(coordinator->UpdatePolicy(v2).ok());
    // v3: 190 distinct globs of 5000 to 5189 bytes (about 1 MB) and one of `last` bytes, whose
    // length varint stays 3 bytes long, so that each byte more of it adds 2 to the total.
    const auto v3 = [&](size_t last) {
      v1::UpdatePolicyRequest req;
      req.set_job_id(id);
      for (int i = 0; i < 191; ++i) {
        v1::LayerPatch* p = req.add_patches();
        p->set_layer("layers.*" + std::string(i < 190 ? 5000 + i : last - 8, '*'));
        p->set_format(v1::FORMAT_BF16);
      }
      return coordinator->UpdatePolicy(req);
    };
    const auto total = [](const absl::Status& s) -> size_t {
      const std::string m(s.message());
      const std::string at = "(v1 to v3, from the recovery point at step 0) to ";
      const size_t pos = m.find(at);
      return pos == std::string::npos ? 0 : std::stoull(m.substr(pos + at.size()));
    };
    constexpr size_t kProbe = 200000;
    auto r = v3(kProbe);
    ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
    const size_t probed = total(r.status());
    ASSERT_GT(probed, kBound + 2) << r.status();
    const size_t target = kBound + (probed - kBound) % 2;  // the bound, or the byte past it
    const size_t last = kProbe - (probed - target) / 2;
    ASSERT_GT(last, 16384u) << "the glob's length varint must not shrink";
    const std::string over = " bytes, over the bound of 2097152 bytes; ";
    size_t accepted_at = 0;
    if (target == kBound) {
      r = v3(last + 1);
      ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
      EXPECT_NE(r.status().message().find(") to 2097154" + over), std::string::npos) << r.status();
      accepted_at = last;
    } else {
      r = v3(last);
      ASSERT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted) << r.status();
      EXPECT_EQ(r.status().message().rfind(
                    "policy history: v3 would bring the policy versions a resumed rank can need "
                    "(v1 to v3, from the recovery point at step 0) to 2097153" +
                        over,
                    0),
                0u)
          << r.status();
      accepted_at = last - 1;
    }
    EXPECT_EQ(Get(id).policy_version(), 2u) << "a refused update makes no version";
    r = v3(accepted_at);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->policy().version(), 3u);
    std::vector<v1::Policy> versions;
    for (const auto& page : Pages(id, 0)) {
      for (const auto& p : page.policies()) versions.push_back(p);
    }
    ASSERT_EQ(versions.size(), 3u);
    EXPECT_EQ(AssignmentPolicyBytes(versions), target == kBound ? kBound : kBound - 1);
    landed.insert(target);
  }
  EXPECT_EQ(landed, (std::set<size_t>{kBound, kBound + 1}));
}

// One UpdatePolicy takes at most 256 patches, and a version holds at most 4096 after
// compaction: each bound holds at its limit and refuses one past it, naming the bound and the
// count.
TEST_F(PolicyHistoryTest, PatchesPerUpdateAndPerVersionHoldAtTheBoundAndRefuseOnePast) {
  ASSERT_EQ(kMaxPatchesPerUpdate, 256) << "docs/job-spec.md and docs/api-limits.md give 256";
  ASSERT_EQ(kMaxPatchesPerVersion, 4096) << "docs/job-spec.md gives 4096";
  const std::string id = Submit(kSpec);
  Worker a = Join("a");
  v1::GetPolicyRequest get;
  get.set_job_id(id);
  ASSERT_EQ(coordinator->GetPolicy(get)->patches_size(), 0);
  auto r = AddGlobs(id, 0, 257);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "patches: at most 256 per update (257)");
  EXPECT_EQ(Get(id).policy_version(), 1u);
  // 16 updates of 256 new globs each: v17 holds 4096 patches. The glob patches are about 21 bytes
  // each, so the versions stay well within the history bound without a checkpoint.
  for (int u = 0; u < 16; ++u) {
    r = AddGlobs(id, 256 * u, 256);
    ASSERT_TRUE(r.ok()) << "update " << u << ": " << r.status();
  }
  EXPECT_EQ(r->policy().version(), 17u);
  EXPECT_EQ(r->policy().patches_size(), 4096);
  r = AddGlobs(id, 4096, 1);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(r.status().message(),
            "patches: policy v18 would hold 4097 patches after compaction, at most 4096; patch "
            "broader globs or fewer distinct layers");
  EXPECT_EQ(Get(id).policy_version(), 17u);
  // The count is taken after compaction: a glob the version holds, set again, replaces its patch.
  v1::UpdatePolicyRequest again;
  again.set_job_id(id);
  again.add_patches()->set_layer(Glob(0));
  again.mutable_patches(0)->set_format(v1::FORMAT_BF16);
  r = coordinator->UpdatePolicy(again);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(r->policy().version(), 18u);
  EXPECT_EQ(r->policy().patches_size(), 4096);
}

TEST_F(PolicyHistoryTest, HistoryPagesByCountAndBytesAndFollowsTokens) {
  const std::string id = Submit(kSpec);
  Worker a = Join("a");
  ASSERT_TRUE(Progress(a, 0, 1).ok());
  // 40 versions of 100 patches more each, taken and checkpointed one by one so that the bound
  // never applies: 4,000 patches (about 80 KB) by v41, 1.6 MB of history in all.
  int64_t step = 0;
  for (int u = 0; u < 40; ++u) {
    auto r = AddGlobs(id, 100 * u, 100);
    ASSERT_TRUE(r.ok()) << r.status();
    step = r->policy().effective_step();
    ASSERT_TRUE(Taken(a, id, r->policy().version(), step, 0).ok());
    ASSERT_TRUE(Progress(a, step, r->policy().version()).ok());
    ASSERT_TRUE(Checkpoint(a, id, step, 0).ok());
  }
  for (int page_size : {0, 7, 1000}) {
    SCOPED_TRACE("page_size " + std::to_string(page_size));
    const auto pages = Pages(id, page_size);
    std::vector<uint64_t> versions;
    for (const auto& page : pages) {
      EXPECT_GE(page.policies_size(), 1);
      EXPECT_LE(page.policies_size(), page_size == 0 ? kDefaultPolicyPageSize : page_size);
      EXPECT_LE(page.ByteSizeLong(), kMaxPolicyPageBytes + 64);
      for (const auto& p : page.policies()) versions.push_back(p.version());
    }
    std::vector<uint64_t> all(41);
    for (size_t i = 0; i < all.size(); ++i) all[i] = i + 1;
    EXPECT_EQ(versions, all) << "every version once, oldest first";
    if (page_size == 7) {
      EXPECT_EQ(pages.size(), 6u);
    } else {
      EXPECT_EQ(pages.size(), 2u) << "1.6 MB in pages of at most 1 MiB";
    }
  }
  v1::ListPolicyVersionsRequest bad;
  bad.set_job_id(id);
  bad.set_page_size(-1);
  auto r = coordinator->ListPolicyVersions(bad);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(), "page_size: must be in [0, 1000], 0 = 100 (-1)");
  bad.set_page_size(1001);
  EXPECT_EQ(coordinator->ListPolicyVersions(bad).status().message(),
            "page_size: must be in [0, 1000], 0 = 100 (1001)");
  bad.set_page_size(0);
  for (const std::string token : {"abc", "0", "1", "42", "-3", "99999999999999999999"}) {
    bad.set_page_token(token);
    r = coordinator->ListPolicyVersions(bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << token;
    EXPECT_EQ(r.status().message(),
              "page_token: not a token this job's history issued (" + token + ")");
  }
  bad.set_page_token("41");
  r = coordinator->ListPolicyVersions(bad);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_EQ(r->policies_size(), 1);
  EXPECT_EQ(r->policies(0).version(), 41u);
  EXPECT_TRUE(r->next_page_token().empty());
}

// A store written before the bound may hold a history no Assignment can carry: the job fails
// with the reason instead of every worker looping on gRPC's limit.
TEST_F(PolicyHistoryTest, AStoredHistoryTooLargeToAssignFailsTheJobWithTheReason) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("geofp8_policy_history_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  Open(dir.string());
  const std::string id = Submit(kSpec);
  v1::GetPolicyRequest get;
  get.set_job_id(id);
  v1::Policy p = *coordinator->GetPolicy(get);
  // Versions as an older coordinator accepted them: 3 of 4,000 patches of 400-byte globs, each
  // taken after step 0 (the recovery point), 1.6 MB each.
  for (int i = 0; i < 4000; ++i) {
    v1::LayerPatch* patch = p.add_patches();
    patch->set_layer("layers.*" + std::string(400, '*') + std::to_string(i));
    patch->set_format(v1::FORMAT_BF16);
  }
  for (uint64_t v = 2; v <= 4; ++v) {
    p.set_version(v);
    p.set_effective_step(10 * v);
    p.set_taken_step(10 * v);
    ASSERT_TRUE(store->PutPolicy(p).ok());
  }
  Open(dir.string());
  Worker a = Join("a");
  EXPECT_TRUE(a.sink->Assignments().empty());
  const v1::Job job = Get(id);
  EXPECT_EQ(job.state(), v1::JOB_FAILED);
  EXPECT_EQ(job.reason().rfind("policy history: an assignment resuming at step 0 would carry 4 "
                               "policy versions in ",
                               0),
            0u)
      << job.reason();
  EXPECT_NE(job.reason().find("over the 4128768-byte bound on what a worker can receive"),
            std::string::npos)
      << job.reason();
  coordinator.reset();
  store.reset();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace geofp8::coordinator
