// Issue #31 item 4: 200 policy updates of 20 new distinct globs each (4,000 patches by v201), all
// taken by the rank and no checkpoint since step 0, then kill -9 of the rank with a spare
// waiting. Before: every update was accepted, the replacement's Assignment came to 8 MB and
// every worker looped on "Received message larger than max (8062141 vs. 4194304)" with the job
// SCHEDULED for good; `policy history` failed the same way. Now the updates past the bound are
// refused with the bound and the size, the job recovers on the spare, and history pages.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "geofp8/v1/geofp8.grpc.pb.h"
#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

// The i-th of many distinct globs that each match every block layer of llama-tiny (a pattern
// that matches no layer is refused): "layers.*[.abc]*".
std::string Glob(int i) {
  std::string code;
  for (int k = 0; k < 3; ++k, i /= 26) code += static_cast<char>('a' + i % 26);
  return "layers.*[." + code + "]*";
}

TEST(PolicyHistoryFaultTest, TwoHundredUpdatesOfNewGlobsThenARankKillTheJobRecovers) {
  CoordinatorProcess coordinator;
  Client client(coordinator.address());
  auto channel = grpc::CreateChannel(coordinator.address(), grpc::InsecureChannelCredentials());
  auto policies = v1::PolicyService::NewStub(channel);
  auto deadline = [](grpc::ClientContext& ctx, seconds s) {
    ctx.set_deadline(std::chrono::system_clock::now() + s);
  };

  WorkerProcess w0(coordinator.address(), "w0", {"--debug-step-delay-ms", "10"});
  // 1,500 steps at 10 ms or more: still running when the updates end (about 2 steps each), and
  // no checkpoint before the kill, so the resumed rank needs every version taken since step 0.
  const v1::Job job = client.Submit(
      "name: history\nmodel: {preset: llama-tiny}\n"
      "training: {steps: 1500, batch_size: 2, seq_len: 16, seed: 3}\n"
      "policy: {margin: 1}\n"
      "checkpoint: {dir: ckpt, every: 100000}\nrestarts: {max_restarts: 2}\n");
  ASSERT_EQ(client.WaitStep(job.id(), 1, seconds(60)).state(), v1::JOB_RUNNING)
      << Describe(client.Get(job.id()), coordinator, {&w0});

  int accepted = 0, refused = 0;
  uint64_t last = 1;
  std::string first_refusal;
  for (int u = 0; u < 200; ++u) {
    v1::UpdatePolicyRequest req;
    req.set_job_id(job.id());
    req.set_reason("update " + std::to_string(u));
    for (int i = 20 * u; i < 20 * u + 20; ++i) {
      v1::LayerPatch* p = req.add_patches();
      p->set_layer(Glob(i));
      p->set_format(i % 2 ? v1::FORMAT_BF16 : v1::FORMAT_FP8_E4M3);
    }
    v1::UpdatePolicyResponse resp;
    grpc::ClientContext ctx;
    deadline(ctx, seconds(30));
    const grpc::Status s = policies->UpdatePolicy(&ctx, req, &resp);
    if (!s.ok()) {
      ++refused;
      EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << s.error_message();
      EXPECT_NE(s.error_message().find("over the bound of 2097152 bytes"), std::string::npos)
          << s.error_message();
      if (first_refusal.empty()) first_refusal = s.error_message();
      continue;
    }
    ++accepted;
    last = resp.policy().version();
    // Wait until the rank took it, so that the resumed rank must replay every version.
    const auto until = std::chrono::steady_clock::now() + seconds(30);
    for (;;) {
      v1::GetPolicyRequest get;
      get.set_job_id(job.id());
      get.set_version(last);
      v1::Policy p;
      grpc::ClientContext gctx;
      deadline(gctx, seconds(10));
      ASSERT_TRUE(policies->GetPolicy(&gctx, get, &p).ok());
      if (p.has_taken_step()) break;
      ASSERT_LT(std::chrono::steady_clock::now(), until)
          << "v" << last << " never taken\n"
          << Describe(client.Get(job.id()), coordinator, {&w0});
      std::this_thread::sleep_for(milliseconds(5));
    }
  }
  std::printf("%d updates accepted (v%llu), %d refused at the bound; the first: %s\n", accepted,
              static_cast<unsigned long long>(last), refused, first_refusal.c_str());
  const v1::Job before = client.Get(job.id());
  ASSERT_EQ(before.state(), v1::JOB_RUNNING) << Describe(before, coordinator, {&w0});
  ASSERT_EQ(before.progress().checkpoint_step(), 0);

  // The rank dies with a spare waiting: the replacement must receive its Assignment and run
  // within the heartbeat timeout (6 s) plus the restart, with headroom for a loaded machine.
  WorkerProcess w1(coordinator.address(), "w1");
  ASSERT_TRUE(client.WaitIdle(1, seconds(30)));
  w0.process().Kill(SIGKILL);
  const auto killed = std::chrono::steady_clock::now();
  v1::Job resumed;
  for (;;) {
    resumed = client.Get(job.id());
    if (resumed.attempt() >= 1 && resumed.state() == v1::JOB_RUNNING) break;
    ASSERT_LT(std::chrono::steady_clock::now() - killed, seconds(30))
        << "not running again 30 s after the kill\n"
        << Describe(resumed, coordinator, {&w0, &w1});
    std::this_thread::sleep_for(milliseconds(50));
  }
  std::printf("running again on the spare %.1f s after the kill\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - killed).count());
  const v1::Job done = client.WaitFinal(job.id(), seconds(150));
  ASSERT_EQ(done.state(), v1::JOB_SUCCEEDED) << Describe(done, coordinator, {&w0, &w1});
  EXPECT_EQ(done.restarts(), 1);
  EXPECT_EQ(w1.Result(job.id(), 1)["policy_version"], std::to_string(last));

  // `policy history` in pages, each under gRPC's limit: every version once, oldest first.
  v1::ListPolicyVersionsRequest list;
  list.set_job_id(job.id());
  uint64_t next = 1;
  int pages = 0;
  do {
    v1::ListPolicyVersionsResponse page;
    grpc::ClientContext ctx;
    deadline(ctx, seconds(10));
    const grpc::Status s = policies->ListPolicyVersions(&ctx, list, &page);
    ASSERT_TRUE(s.ok()) << s.error_message();
    for (const auto& p : page.policies()) EXPECT_EQ(p.version(), next++);
    list.set_page_token(page.next_page_token());
    ++pages;
  } while (!list.page_token().empty() && pages < 1000);
  EXPECT_EQ(next, last + 1);
#ifdef GEOFP8CTL_BIN
  ChildProcess ctl({GEOFP8CTL_BIN, "-s", coordinator.address(), "policy", "history", job.id()});
  ASSERT_EQ(ctl.Wait(milliseconds(60000)), 0) << ctl.output();
  int rows = 0;
  std::istringstream lines(ctl.output());
  for (std::string line; std::getline(lines, line);) rows += line.rfind("v", 0) == 0;
  EXPECT_EQ(rows, static_cast<int>(last)) << ctl.output().substr(0, 2000);
#endif
}

}  // namespace
}  // namespace geofp8::testing
