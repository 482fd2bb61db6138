// A `command:` job whose program ignores SIGTERM: a cancel sends SIGTERM to its process group,
// and the worker must SIGKILL the group once the grace period (5 s) has passed, not before, and
// never leave it running; the worker is then free for the next job.
#include <gtest/gtest.h>
#include <signal.h>

#include <cerrno>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <string>

#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr int64_t kKillGraceMs = 5000;  // CommandRunnerOptions::kill_grace

// The `ts=` of the first line of `output` that contains `text`, in ms since the epoch; -1 if none.
int64_t LoggedMs(const std::string& output, const std::string& text) {
  const size_t at = output.find(text);
  if (at == std::string::npos) return -1;
  const size_t begin = output.rfind('\n', at) == std::string::npos ? 0 : output.rfind('\n', at) + 1;
  const size_t ts = output.find("ts=", begin);
  if (ts == std::string::npos || ts > at) return -1;
  std::tm tm = {};
  int ms = 0;
  if (std::sscanf(output.c_str() + ts + 3, "%d-%d-%dT%d:%d:%d.%dZ", &tm.tm_year, &tm.tm_mon,
                  &tm.tm_mday, &tm.tm_hour, &tm.tm_min, &tm.tm_sec, &ms) != 7) {
    return -1;
  }
  tm.tm_year -= 1900;
  tm.tm_mon -= 1;
  return int64_t(timegm(&tm)) * 1000 + ms;
}

// The pid the program wrote to `path`; -1 until it has.
pid_t ReadPid(const std::string& path) {
  std::ifstream in(path);
  long pid = -1;
  return in >> pid ? pid_t(pid) : -1;
}

TEST(KillEscalationFaultTest, AProgramThatIgnoresSigtermIsKilledAfterTheGrace) {
  CoordinatorProcess coordinator;
  Client client(coordinator.address());
  WorkerProcess worker(coordinator.address(), "w0", {"--allow-commands"});
  ASSERT_TRUE(client.WaitIdle(1, seconds(30))) << worker.process().output();
  TempDir out("geofp8-stubborn");
  const std::string pid_file = out.path() + "/pid";
  // sh ignores SIGTERM, and its children (sleep) inherit the ignored disposition: nothing in
  // the group ends on SIGTERM.
  const v1::Job job = client.Submit(
      "name: stubborn\nworld_size: 1\ncommand: [/bin/sh, -c, 'trap \"\" TERM; echo $$ > " +
      pid_file + "; while :; do sleep 0.1; done']\ntraining: {steps: 10}\n");
  pid_t pid = -1;
  const auto deadline = std::chrono::steady_clock::now() + seconds(60);
  while ((pid = ReadPid(pid_file)) <= 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(milliseconds(20));
  }
  ASSERT_GT(pid, 0) << Describe(client.Get(job.id()), coordinator, {&worker});

  auto channel = grpc::CreateChannel(coordinator.address(), grpc::InsecureChannelCredentials());
  auto jobs = v1::JobService::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + seconds(10));
  v1::CancelJobRequest req;
  req.set_job_id(job.id());
  req.set_reason("test: stop a program that ignores SIGTERM");
  v1::Job cancelled;
  ASSERT_TRUE(jobs->CancelJob(&ctx, req, &cancelled).ok());

  // The worker notes the SIGTERM and, the grace later, the SIGKILL; the program is gone.
  ASSERT_TRUE(worker.process().WaitFor(": SIGTERM to process group " + std::to_string(pid),
                                       milliseconds(60000)))
      << worker.process().output();
  EXPECT_EQ(::kill(pid, 0), 0) << "the program ended on SIGTERM, which it ignores";
  ASSERT_TRUE(worker.process().WaitFor(
      "still running " + std::to_string(kKillGraceMs) + " ms after SIGTERM: SIGKILL",
      milliseconds(60000)))
      << worker.process().output();
  const auto gone_by = std::chrono::steady_clock::now() + seconds(30);
  while (::kill(pid, 0) == 0 && std::chrono::steady_clock::now() < gone_by) {
    std::this_thread::sleep_for(milliseconds(20));  // a zombie until the worker reaps it
  }
  EXPECT_EQ(::kill(pid, 0), -1) << "the program still runs after the SIGKILL";
  EXPECT_EQ(errno, ESRCH);
  // Not before the grace, on the worker's own clock (its log's timestamps).
  const std::string log = worker.process().output();
  const int64_t term_ms = LoggedMs(log, ": SIGTERM to process group ");
  const int64_t kill_ms = LoggedMs(log, " ms after SIGTERM: SIGKILL");
  ASSERT_GT(term_ms, 0) << log;
  ASSERT_GT(kill_ms, 0) << log;
  std::printf("SIGKILL %.3f s after SIGTERM (grace %.1f s)\n", (kill_ms - term_ms) / 1000.0,
              kKillGraceMs / 1000.0);
  EXPECT_GE(kill_ms - term_ms, kKillGraceMs) << log;

  // The rank ends as stopped, the job stays CANCELLED, and the worker takes the next job.
  EXPECT_TRUE(worker.process().WaitFor("event=rank.finished", milliseconds(30000)))
      << worker.process().output();
  EXPECT_EQ(client.WaitFinal(job.id(), seconds(30)).state(), v1::JOB_CANCELLED);
  ASSERT_TRUE(client.WaitIdle(1, seconds(60))) << worker.process().output();
  const v1::Job next = client.WaitFinal(
      client.Submit("name: next\nworld_size: 1\ncommand: [/bin/true]\ntraining: {steps: 1}\n").id(),
      seconds(60));
  EXPECT_EQ(next.state(), v1::JOB_SUCCEEDED) << next.reason();
}

}  // namespace
}  // namespace geofp8::testing
