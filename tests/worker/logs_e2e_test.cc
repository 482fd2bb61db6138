// `geofp8ctl logs` end to end (issue #29 item 5): a real geofp8-coordinator and geofp8-worker run
// a user's own shell script as a command job, and geofp8ctl prints its output, --tail's last
// lines, --stderr, follows (-f) what the script writes after the call started until the rank
// ends, and is refused without the token. A stalled reader does not hold back the worker.
#include <gtest/gtest.h>
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>
#include <thread>

#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::seconds;
constexpr const char* kToken = "logs-test-token-0123456789";

class LogsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    token_file_ = dir_.path() + "/token";
    std::ofstream(token_file_) << kToken << "\n";
    coordinator_ = std::make_unique<CoordinatorProcess>(
        std::vector<std::string>{"--token-file", token_file_, "--heartbeat-timeout-ms", "2000"});
    worker_ = std::make_unique<WorkerProcess>(
        coordinator_->address(), "w0",
        std::vector<std::string>{"--token-file", token_file_, "--allow-commands"});
    client_ = std::make_unique<Client>(coordinator_->address(), kToken);
    ASSERT_TRUE(client_->WaitIdle(1, seconds(30))) << worker_->process().output();
  }
  // Submits a job that runs `script` (sh) on one rank.
  std::string Run(const std::string& name, const std::string& script) {
    const std::string path = dir_.path() + "/" + name + ".sh";
    std::ofstream(path) << script;
    return client_->Submit("name: " + name + "\nworld_size: 1\ncommand: [/bin/sh, " + path + "]\n")
        .id();
  }
  // geofp8ctl with `args` (and the token unless `with_token` is false).
  std::unique_ptr<ChildProcess> Ctl(std::vector<std::string> args, bool with_token = true) {
    std::vector<std::string> argv = {GEOFP8CTL_BIN, "-s", coordinator_->address()};
    if (with_token) argv.insert(argv.end(), {"--token-file", token_file_});
    argv.insert(argv.end(), args.begin(), args.end());
    return std::make_unique<ChildProcess>(argv);
  }
  std::string Output(std::vector<std::string> args, int* rc, bool with_token = true) {
    auto p = Ctl(std::move(args), with_token);
    *rc = p->Wait(std::chrono::milliseconds(30000));
    return p->output();
  }

  TempDir dir_{"geofp8-logs"};
  std::string token_file_;
  std::unique_ptr<CoordinatorProcess> coordinator_;
  std::unique_ptr<WorkerProcess> worker_;
  std::unique_ptr<Client> client_;
};

TEST_F(LogsTest, PrintsTheScriptsOutputItsTailAndItsStderrOnlyWithTheToken) {
  const std::string id = Run("hello",
                             "for i in 1 2 3 4 5; do echo \"line $i\"; done\n"
                             "echo 'a warning' >&2\n");
  ASSERT_EQ(client_->WaitFinal(id, seconds(60)).state(), v1::JOB_SUCCEEDED)
      << worker_->process().output();
  int rc = -1;
  EXPECT_EQ(Output({"logs", id}, &rc), "line 1\nline 2\nline 3\nline 4\nline 5\n");
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(Output({"logs", "hello", "--tail", "2"}, &rc), "line 4\nline 5\n");  // by name
  EXPECT_EQ(rc, 0);
  EXPECT_EQ(Output({"logs", id, "--stderr"}, &rc), "a warning\n");
  EXPECT_EQ(rc, 0);
  // -f on a rank that has ended prints everything and ends.
  EXPECT_EQ(Output({"logs", "-f", id}, &rc), "line 1\nline 2\nline 3\nline 4\nline 5\n");
  EXPECT_EQ(rc, 0);

  // Without the token: refused, and nothing of the output shows.
  std::string out = Output({"logs", id}, &rc, /*with_token=*/false);
  EXPECT_EQ(rc, 6) << out;
  EXPECT_NE(out.find("authorization: missing bearer token"), std::string::npos) << out;
  EXPECT_EQ(out.find("line 1"), std::string::npos) << out;
  // The RPC itself, with the job id (the CLI's name lookup is refused before it).
  v1::LogsRequest req;
  req.set_job_id(id);
  grpc::ClientContext ctx;
  auto stub = v1::JobService::NewStub(
      grpc::CreateChannel(coordinator_->address(), grpc::InsecureChannelCredentials()));
  auto reader = stub->Logs(&ctx, req);
  v1::LogsChunk chunk;
  EXPECT_FALSE(reader->Read(&chunk));
  EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::UNAUTHENTICATED);

  // Clear errors: a rank out of range, an unknown job.
  out = Output({"logs", id, "--rank", "1"}, &rc);
  EXPECT_EQ(rc, 5) << out;
  EXPECT_NE(out.find("rank: job " + id + " has ranks 0..0 (1)"), std::string::npos) << out;
  out = Output({"logs", "no-such-job"}, &rc);
  EXPECT_EQ(rc, 3) << out;
}

// -f prints what the script writes after the call started, and exits 0 when the rank ends.
TEST_F(LogsTest, FollowPrintsOutputWrittenLaterAndEndsWithTheRank) {
  const std::string go = dir_.path() + "/go";
  const std::string id = Run("follow",
                             "echo before\n"
                             "while [ ! -e " +
                                 go +
                                 " ]; do sleep 0.05; done\n"
                                 "echo after\nsleep 0.5\necho last\n");
  auto follow = Ctl({"logs", "-f", id});
  ASSERT_TRUE(follow->WaitFor("before\n", std::chrono::milliseconds(30000)))
      << follow->output() << worker_->process().output();
  EXPECT_TRUE(follow->running());
  std::ofstream(go) << "1";
  EXPECT_EQ(follow->Wait(std::chrono::milliseconds(30000)), 0) << follow->output();
  EXPECT_EQ(follow->output(), "before\nafter\nlast\n");
  EXPECT_EQ(client_->WaitFinal(id, seconds(30)).state(), v1::JOB_SUCCEEDED);
}

// A reader that stops reading (SIGSTOP) holds back only its own stream: the worker keeps its
// heartbeats (it stays connected and its job ends on time), and other readers are served.
TEST_F(LogsTest, AStalledReaderDoesNotHoldBackTheWorker) {
  const std::string go = dir_.path() + "/go";
  // About 8 MB, far more than gRPC's and the pipes' buffers together, written by a few processes
  // (not 2000 spawns, which take tens of seconds on loaded cores and would stall the reader past
  // gRPC's transport timeout, about 20 s, after which the connection is dropped).
  const std::string id = Run("chatty",
                             "yes \"$(printf '%4000s' '' | tr ' ' x)\" | head -n 2000\n"
                             "echo written\n"
                             "while [ ! -e " +
                                 go + " ]; do sleep 0.05; done\necho done\n");
  auto stalled = Ctl({"logs", "-f", id});
  ASSERT_TRUE(stalled->WaitFor("xxxx", std::chrono::milliseconds(30000))) << stalled->output();
  stalled->Kill(SIGSTOP);
  // Stalled for longer than the heartbeat timeout (2 s here): a worker whose session waited on
  // this reader would be declared dead and its job restarted.
  std::this_thread::sleep_for(std::chrono::seconds(3));
  // Other readers are served while it stays stalled; on a loaded machine the script may still be
  // writing, so wait for the line it prints after its 2000.
  int rc = -1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  std::string last;
  while ((last = Output({"logs", id, "--tail", "1"}, &rc)) != "written\n" &&
         std::chrono::steady_clock::now() < deadline) {
    ASSERT_EQ(rc, 0) << last;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  ASSERT_EQ(last, "written\n") << worker_->process().output();
  EXPECT_EQ(Output({"logs", id, "--tail", "2"}, &rc), std::string(4000, 'x') + "\nwritten\n");
  EXPECT_EQ(rc, 0);
  std::ofstream(go) << "1";
  const v1::Job done = client_->WaitFinal(id, seconds(30));
  EXPECT_EQ(done.state(), v1::JOB_SUCCEEDED) << done.reason();
  EXPECT_EQ(done.restarts(), 0);
  for (const auto& w : client_->Workers()) EXPECT_NE(w.state(), v1::WORKER_DEAD) << w.id();
  stalled->Kill(SIGCONT);
  EXPECT_EQ(stalled->Wait(std::chrono::milliseconds(60000)), 0);
  EXPECT_NE(stalled->output().find("done\n"), std::string::npos);
}

// A script that crashes on its first attempt (issue #40 items 3 and 4): the job's event names
// the command that shows the crashed attempt's stderr, and that command shows it; `logs -f`
// says on stderr that the attempt ended and the job restarts, then prints the next attempt's
// output, and ends with the job.
TEST_F(LogsTest, FollowGoesOnIntoTheNextAttemptAndTheReasonNamesTheLogsCommand) {
  const std::string go = dir_.path() + "/go";
  const std::string script_path = dir_.path() + "/crash-once.sh";
  std::ofstream(script_path) << "echo \"attempt $GEOFP8_ATTEMPT starts\"\n"
                                "echo \"stderr of attempt $GEOFP8_ATTEMPT\" >&2\n"
                                "if [ \"$GEOFP8_ATTEMPT\" = 0 ]; then\n"
                                "  while [ ! -e " +
                                    go +
                                    " ]; do sleep 0.05; done\n"
                                    "  exit 3\n"
                                    "fi\n"
                                    "echo \"attempt $GEOFP8_ATTEMPT done\"\n";
  const std::string id = client_
                             ->Submit("name: crash-once\ncommand: [/bin/sh, " + script_path +
                                      "]\nrestarts: {max_restarts: 1}\n")
                             .id();
  // geofp8ctl's stderr into a file of its own, to tell its note from the program's output.
  const std::string note_file = dir_.path() + "/follow.err";
  ChildProcess follow({"/bin/sh", "-c", "exec \"$0\" \"$@\" 2>" + note_file, GEOFP8CTL_BIN, "-s",
                       coordinator_->address(), "--token-file", token_file_, "logs", "-f",
                       "crash-once"});
  ASSERT_TRUE(follow.WaitFor("attempt 0 starts\n", std::chrono::milliseconds(30000)))
      << follow.output() << worker_->process().output();
  std::ofstream(go) << "1";
  EXPECT_EQ(follow.Wait(std::chrono::milliseconds(90000)), 0) << follow.output();
  EXPECT_EQ(follow.output(), "attempt 0 starts\nattempt 1 starts\nattempt 1 done\n");
  std::ifstream note_in(note_file);
  std::string note((std::istreambuf_iterator<char>(note_in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(note.rfind("geofp8ctl: job " + id +
                           " attempt 0 ended (rank 0 failed: command '/bin/sh' exited with "
                           "code 3; its output stays on worker w0 (",
                       0),
            0u)
      << note;
  EXPECT_NE(note.find("; restart 1/1"), std::string::npos) << note;
  EXPECT_NE(note.find("); following attempt 1\n"), std::string::npos) << note;
  const v1::Job job = client_->WaitFinal(id, seconds(30));
  ASSERT_EQ(job.state(), v1::JOB_SUCCEEDED) << job.reason();

  // The restart's event names the command that shows the crash; run as it says, it does.
  std::string command;
  const v1::Job with_events = client_->Get(id);
  for (const auto& e : with_events.events()) {
    const size_t at = e.message().find("geofp8ctl logs ");
    if (at != std::string::npos) command = e.message().substr(at, e.message().find(';', at) - at);
  }
  ASSERT_EQ(command, "geofp8ctl logs " + id + " --rank 0 --attempt 0 --stderr");
  std::vector<std::string> args;
  std::istringstream words(command.substr(std::string("geofp8ctl ").size()));
  for (std::string w; words >> w;) args.push_back(w);
  int rc = -1;
  EXPECT_EQ(Output(args, &rc), "stderr of attempt 0\n");
  EXPECT_EQ(rc, 0);
  // Without -f: the newest attempt only.
  EXPECT_EQ(Output({"logs", "crash-once"}, &rc), "attempt 1 starts\nattempt 1 done\n");
}

}  // namespace
}  // namespace geofp8::testing
