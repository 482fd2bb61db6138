// The hook channel in one process: the worker's HookServer and the program's HookClient over a
// real Unix socket. Policy versions come down and are handed out at their effective step with
// per-layer resolution; reports go up; a restarted server is reattached to and gets the catalog
// again; a client whose server is gone still closes promptly.
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <functional>
#include <mutex>
#include <thread>

#include "geofp8/v1/geofp8.grpc.pb.h"
#include "kernels/common/check.h"
#include "platform/policy/policy.h"
#include "worker/daemon/hook_server.h"
#include "worker/hook/hook_client.h"

namespace geofp8 {
namespace {

using std::chrono::milliseconds;

class Relay {
 public:
  worker::HookServer::RelayFn fn() {
    return [this](const v1::HookMessage& m) {
      std::lock_guard<std::mutex> lock(mu_);
      got_.push_back(m);
    };
  }
  // Whether a message that `pred` accepts was relayed already.
  bool Seen(const std::function<bool(const v1::HookMessage&)>& pred) {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& m : got_) {
      if (pred(m)) return true;
    }
    return false;
  }
  // Waits up to 5 s for a message that `pred` accepts.
  bool WaitFor(const std::function<bool(const v1::HookMessage&)>& pred) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (std::chrono::steady_clock::now() < deadline) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        for (const auto& m : got_) {
          if (pred(m)) return true;
        }
      }
      std::this_thread::sleep_for(milliseconds(10));
    }
    return false;
  }

 private:
  std::mutex mu_;
  std::vector<v1::HookMessage> got_;
};

v1::Policy MakePolicy(uint64_t version, int64_t effective, const std::string& patch_format) {
  v1::Policy p;
  p.set_job_id("job-1");
  p.set_version(version);
  p.set_effective_step(effective);
  p.set_reason("v" + std::to_string(version));
  p.mutable_default_policy()->set_format(v1::FORMAT_FP8_E4M3);
  p.mutable_default_policy()->set_geometry(v1::GEOMETRY_LOWRANK);
  p.mutable_default_policy()->set_rank(4);
  if (!patch_format.empty()) {
    auto* patch = p.add_patches();
    patch->set_layer("layers.*");
    patch->set_format(ToProto(*ParseFormatName(patch_format)));
  }
  return p;
}

class HookChannelTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/geofp8-hookch-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    socket_ = dir_ + "/h.sock";
    ::setenv("RANK", "1", 1);
    ::setenv("WORLD_SIZE", "2", 1);
    ::setenv("GEOFP8_JOB_ID", "job-1", 1);
    ::setenv("GEOFP8_ATTEMPT", "3", 1);
    ::setenv("GEOFP8_RESUME_STEP", "0", 1);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::unique_ptr<worker::HookServer> Serve(std::vector<v1::Policy> policies) {
    v1::HookWelcome w;
    w.set_job_id("job-1");
    w.set_rank(1);
    w.set_world_size(2);
    auto s = worker::HookServer::Start(socket_, w, std::move(policies), relay_.fn());
    EXPECT_TRUE(s.ok()) << s.status();
    return s.ok() ? std::move(*s) : nullptr;
  }

  std::string dir_, socket_;
  Relay relay_;
};

TEST_F(HookChannelTest, FromEnvironmentNeedsTheHookAddress) {
  ::unsetenv("GEOFP8_HOOK_ADDRESS");
  EXPECT_EQ(hook::HookClient::FromEnvironment(), nullptr);
}

// The catalog carries the program's model name (what the coordinator's messages call the model),
// on the first channel and when the client sends the catalog again after reattaching; the server
// counts every stream that attached, so a program that attached and left is told from one that
// never did (CommandRunner's note).
TEST_F(HookChannelTest, TheCatalogCarriesTheModelNameAndAttachesAreCounted) {
  auto server = Serve({MakePolicy(1, 0, "")});
  ASSERT_NE(server, nullptr);
  EXPECT_EQ(server->attaches(), 0);
  auto client = hook::HookClient::Connect("unix:" + socket_);
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->WaitForPolicy(std::chrono::seconds(5)));
  client->SendCatalog({{"fc1.weight", 4, 4}}, "my-gpt");
  EXPECT_TRUE(relay_.WaitFor([](const v1::HookMessage& m) {
    return m.has_catalog() && m.catalog().model_name() == "my-gpt";
  }));
  EXPECT_EQ(server->attaches(), 1);

  server.reset();
  Relay second;
  const auto gone = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (client->connected() && std::chrono::steady_clock::now() < gone) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  // The client reattaches and sends the catalog again, with its name.
  auto again =
      worker::HookServer::Start(socket_, v1::HookWelcome(), {MakePolicy(1, 0, "")}, second.fn());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(second.WaitFor([](const v1::HookMessage& m) {
    return m.has_catalog() && m.catalog().model_name() == "my-gpt";
  }));
  client.reset();  // the program left
  const auto left = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while ((*again)->attached() > 0 && std::chrono::steady_clock::now() < left) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_EQ((*again)->attached(), 0);
  EXPECT_EQ((*again)->attaches(), 1);
}

// #41 item 1: the hook socket checks what a program sends against the request bounds
// (proto/bounds.h): a message past them ends the stream naming the field, and none of it is
// relayed to the coordinator (which would end the worker's session for it).
TEST_F(HookChannelTest, AMessagePastItsBoundsEndsTheStreamAndIsNotRelayed) {
  auto server = Serve({MakePolicy(1, 0, "")});
  ASSERT_NE(server, nullptr);
  auto stub = v1::HookService::NewStub(
      grpc::CreateChannel("unix:" + socket_, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  auto stream = stub->Attach(&ctx);
  v1::HookMessage fine, bad;
  fine.mutable_catalog()->set_model_name("fine");
  fine.mutable_catalog()->add_layers()->set_name("layers.0.w");
  bad.mutable_catalog()->set_model_name("bad");
  bad.mutable_catalog()->add_layers()->set_name("layers.0.w\x1b[2J");
  ASSERT_TRUE(stream->Write(fine));
  ASSERT_TRUE(
      relay_.WaitFor([](const v1::HookMessage& m) { return m.catalog().model_name() == "fine"; }));
  stream->Write(bad);
  stream->WritesDone();
  v1::HookCommand c;
  while (stream->Read(&c)) {
  }
  const grpc::Status s = stream->Finish();
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(s.error_message(),
            "catalog.layers[0].name: must be one line of text, no control codes (byte 10 is 0x1b)");
  // The server relays a message before it reads the next, and ended the stream after reading
  // this one: had it been relayed, it would be there now.
  EXPECT_FALSE(
      relay_.Seen([](const v1::HookMessage& m) { return m.catalog().model_name() == "bad"; }));
}

TEST_F(HookChannelTest, PoliciesComeDownAtTheirStepReportsGoUpAndTheClientReattaches) {
  auto server = Serve({MakePolicy(1, 0, "")});
  ASSERT_NE(server, nullptr);
  ::setenv("GEOFP8_HOOK_ADDRESS", ("unix:" + socket_).c_str(), 1);
  auto client = hook::HookClient::FromEnvironment();
  ASSERT_NE(client, nullptr);
  EXPECT_EQ(client->rank(), 1);
  EXPECT_EQ(client->world_size(), 2);
  EXPECT_EQ(client->attempt(), 3);
  EXPECT_EQ(client->job_id(), "job-1");
  ASSERT_TRUE(client->WaitForPolicy(std::chrono::seconds(5)));
  client->SendCatalog({{"layers.0.w", 4, 4}, {"layers.0.b", 4, 1}, {"head", 4, 4}});

  auto v1 = client->PolicyDueAt(0);
  ASSERT_TRUE(v1.has_value());
  EXPECT_EQ(v1->version, 1u);
  ASSERT_EQ(v1->layers.size(), 3u);
  EXPECT_EQ(v1->layers[0].policy.format(), v1::FORMAT_FP8_E4M3);
  EXPECT_EQ(v1->layers[0].policy.geometry(), v1::GEOMETRY_LOWRANK);
  EXPECT_EQ(v1->layers[1].policy.geometry(), v1::GEOMETRY_NONE);  // 1-D: never geometry
  EXPECT_FALSE(client->PolicyDueAt(1).has_value());               // nothing new
  EXPECT_EQ(client->version_in_force(), 1u);

  // v2 takes effect at step 5: not before, exactly there.
  server->OfferPolicy(MakePolicy(2, 5, "nvfp4"));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_FALSE(client->PolicyDueAt(4).has_value());
  std::optional<hook::PolicyChange> v2;
  while (!(v2 = client->PolicyDueAt(5)) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  ASSERT_TRUE(v2.has_value());
  EXPECT_EQ(v2->version, 2u);
  EXPECT_EQ(v2->effective_step, 5);
  EXPECT_EQ(v2->layers[0].policy.format(), v1::FORMAT_NVFP4);
  EXPECT_EQ(v2->layers[2].policy.format(), v1::FORMAT_FP8_E4M3);  // "head" is no match of layers.*
  client->ReportStep(5, 2.5, 100.0, 10, 40);
  client->ReportStep(6, 2.4, 100.0, 12, 48, 0.5, 0.1, 2.75);  // a step that validated
  EXPECT_THROW(client->ReportStep(7, 2.4, 100.0, 12, 48, 0.5, 0.1, std::nan("")), geofp8::Error);
  client->ReportLayers({{"layers.0.w", 5, 0.02, 0.01, 1, 0.0}});
  v1::ProbeResult probe;
  probe.set_layer("layers.0.w");
  probe.set_error_without(0.3);
  probe.set_error_with(0.1);
  client->ReportProbes({probe});

  EXPECT_TRUE(relay_.WaitFor(
      [](const v1::HookMessage& m) { return m.has_catalog() && m.catalog().layers_size() == 3; }));
  EXPECT_TRUE(relay_.WaitFor([](const v1::HookMessage& m) {
    return m.has_policy_ack() && m.policy_ack().version() == 2;
  }));
  EXPECT_TRUE(relay_.WaitFor([](const v1::HookMessage& m) {
    return m.has_progress() && m.progress().step() == 5 && m.progress().policy_version() == 2 &&
           m.progress().bytes_baseline() == 40 && !m.progress().has_val_loss();
  }));
  EXPECT_TRUE(relay_.WaitFor([](const v1::HookMessage& m) {
    return m.has_progress() && m.progress().step() == 6 && m.progress().has_val_loss() &&
           m.progress().val_loss() == 2.75 && m.progress().step_seconds() == 0.5;
  }));
  EXPECT_TRUE(relay_.WaitFor([](const v1::HookMessage& m) {
    return m.has_summaries() && m.summaries().layers(0).rel_fro_error() == 0.02;
  }));

  EXPECT_TRUE(relay_.WaitFor([](const v1::HookMessage& m) {
    return m.has_probes() && m.probes().probes(0).error_with() == 0.1;
  }));

  // The worker restarts its hook server: the client reattaches and sends its catalog again; a
  // checkpoint reported while it was away is delivered once it is back.
  server.reset();
  Relay second;
  const auto gone = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (client->connected() && std::chrono::steady_clock::now() < gone) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  EXPECT_FALSE(client->connected());
  client->ReportCheckpoint(10, "/ckpt/10");
  v1::HookWelcome w;
  auto again = worker::HookServer::Start(
      socket_, w, {MakePolicy(1, 0, ""), MakePolicy(2, 5, "nvfp4")}, second.fn());
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(second.WaitFor(
      [](const v1::HookMessage& m) { return m.has_catalog() && m.catalog().layers_size() == 3; }));
  EXPECT_TRUE(second.WaitFor([](const v1::HookMessage& m) {
    return m.has_checkpoint() && m.checkpoint().step() == 10 && m.checkpoint().path() == "/ckpt/10";
  }));
  EXPECT_TRUE(client->connected());
  // Versions already in force are not handed out again.
  EXPECT_FALSE(client->PolicyDueAt(6).has_value());

  // Closing with the server gone takes no longer than the client's close wait.
  again->reset();
  const auto t0 = std::chrono::steady_clock::now();
  client.reset();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(4));
}

// PolicyAgreedAt, the built-in trainer's rule: a version applies at the first step at or after its
// effective step at which every rank holds it (`agreed`), and is acknowledged with that step; the
// welcome and the refresh schedule come down as they arrive.
TEST_F(HookChannelTest, AgreedVersionsApplyOnlyOnceEveryRankHoldsThemAndAckTheirStep) {
  auto server = Serve({MakePolicy(1, 0, "")});
  ASSERT_NE(server, nullptr);
  auto client = hook::HookClient::Connect("unix:" + socket_);
  const auto welcome = client->WaitForWelcome(std::chrono::seconds(5));
  ASSERT_TRUE(welcome.has_value());
  EXPECT_EQ(welcome->world_size(), 2);
  EXPECT_EQ(welcome->rank(), 1);
  ASSERT_TRUE(client->WaitForPolicy(std::chrono::seconds(5)));
  EXPECT_FALSE(client->WaitForRefresh(milliseconds(50)).has_value());
  client->SendCatalog({{"layers.0.w", 4, 4}});
  // The start step: the version in force there, acknowledged with it.
  auto first = client->PolicyAgreedAt(0, 1);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->version, 1u);
  EXPECT_TRUE(relay_.WaitFor([](const v1::HookMessage& m) {
    return m.has_policy_ack() && m.policy_ack().version() == 1 && m.policy_ack().step() == 0;
  }));

  server->OfferPolicy(MakePolicy(2, 3, "nvfp4"));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (client->NewestHeld() < 2 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  ASSERT_EQ(client->NewestHeld(), 2u);
  EXPECT_FALSE(client->PolicyAgreedAt(2, 2).has_value());  // before its effective step
  EXPECT_FALSE(client->PolicyAgreedAt(3, 1).has_value());  // another rank lacks it
  EXPECT_FALSE(client->PolicyAgreedAt(4, 1).has_value());
  auto v2 = client->PolicyAgreedAt(5, 2);  // every rank holds it from step 5
  ASSERT_TRUE(v2.has_value());
  EXPECT_EQ(v2->version, 2u);
  EXPECT_EQ(v2->layers.at(0).policy.format(), v1::FORMAT_NVFP4);
  EXPECT_EQ(client->version_in_force(), 2u);
  EXPECT_FALSE(client->PolicyAgreedAt(6, 2).has_value());
  EXPECT_TRUE(relay_.WaitFor([](const v1::HookMessage& m) {
    return m.has_policy_ack() && m.policy_ack().version() == 2 && m.policy_ack().step() == 5;
  }));
  v1::RefreshSchedules r;
  r.add_schedules()->set_layer("layers.0.w");
  server->OfferRefresh(r);
  const auto got = client->WaitForRefresh(std::chrono::seconds(5));
  ASSERT_TRUE(got.has_value());
  ASSERT_EQ(got->size(), 1u);
  EXPECT_EQ(got->at(0).layer(), "layers.0.w");
}

// A resumed attempt: the version in force at its start step is the one taken at or before it,
// and a version taken later replays exactly at its taken_step; untaken versions wait for it.
TEST_F(HookChannelTest, AResumedAttemptReplaysTakenVersionsAtTheirTakenStep) {
  v1::Policy p1 = MakePolicy(1, 0, ""), p2 = MakePolicy(2, 8, "nvfp4"),
             p3 = MakePolicy(3, 14, "fp8_e5m2"), p4 = MakePolicy(4, 15, "bf16");
  p1.set_taken_step(0);
  p2.set_taken_step(10);
  p3.set_taken_step(16);
  auto server = Serve({p1, p2, p3, p4});
  ASSERT_NE(server, nullptr);
  auto client = hook::HookClient::Connect("unix:" + socket_);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (client->NewestHeld() < 4 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(10));
  }
  ASSERT_EQ(client->NewestHeld(), 4u);
  auto start = client->PolicyAgreedAt(9, 4);  // v2 was effective at 8 but taken at 10
  ASSERT_TRUE(start.has_value());
  EXPECT_EQ(start->version, 1u);
  auto v2 = client->PolicyAgreedAt(10, 4);
  ASSERT_TRUE(v2.has_value());
  EXPECT_EQ(v2->version, 2u);
  // v4 (effective 15, untaken) waits while v3's replay is ahead; at v3's taken_step the newest
  // due version wins, as in the built-in trainer (job_runner.cc TakeDuePolicy).
  EXPECT_FALSE(client->PolicyAgreedAt(15, 4).has_value());
  auto v4 = client->PolicyAgreedAt(16, 4);
  ASSERT_TRUE(v4.has_value());
  EXPECT_EQ(v4->version, 4u);
  EXPECT_FALSE(client->PolicyAgreedAt(17, 4).has_value());
  EXPECT_TRUE(relay_.WaitFor([](const v1::HookMessage& m) {
    return m.has_policy_ack() && m.policy_ack().version() == 1 && m.policy_ack().step() == 0;
  }));
  EXPECT_TRUE(relay_.WaitFor([](const v1::HookMessage& m) {
    return m.has_policy_ack() && m.policy_ack().version() == 4 && m.policy_ack().step() == 16;
  }));
}

}  // namespace
}  // namespace geofp8
