// A network partition between the coordinator and its workers, longer than the heartbeat timeout
// (issue #13, #2). The coordinator runs in one network namespace with a bridge, each worker in
// its own namespace on a veth into that bridge, and the test reaches the coordinator over a
// veth from the root namespace. Blackhole routes cut coordinator <-> worker traffic both ways
// for 12 s (the default heartbeat timeout is 6 s); the workers still reach each other, so the
// ranks keep training. The coordinator declares both workers dead and fails the attempt; when
// the routes return, the workers find their generation fenced, stop their ranks, register
// again and report the checkpoints they hold. The job must resume from the newest step both
// ranks hold (at most one checkpoint interval redone), run again within 5 s of the link's
// return, and end SUCCEEDED with the checksum of a fault-free run.
//
// Root only (label `netns`): skipped with the reason when not root, when `ip` is missing or when
// `ip netns add` is refused. Every namespace and link is named gfp<pid>*, removed by the Lab's
// destructor whatever the test did, and the test checks that none is left.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tests/faults/reference_run.h"
#include "tests/worker/worker_process.h"

namespace geofp8::testing {
namespace {

using std::chrono::milliseconds;
using std::chrono::seconds;

constexpr int kEvery = 5;              // checkpoint interval, steps
constexpr int kPartitionSeconds = 12;  // > the coordinator's default 6 s heartbeat timeout
constexpr int kStepDelayMs = 50;
// The ranks keep training through the partition: at 50+ ms a step it covers at most 240 steps,
// so the job is still running when the link returns.
constexpr int kSteps = 40 + kPartitionSeconds * 1000 / kStepDelayMs + 40;

std::string IpBin() {
  for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"}) {
    if (::access(p, X_OK) == 0) return p;
  }
  return "";
}

// Runs a shell command; its exit status.
int Sh(const std::string& cmd) {
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}
std::string ShOut(const std::string& cmd) {
  std::string out;
  FILE* f = ::popen(cmd.c_str(), "r");
  if (!f) return out;
  char buf[512];
  while (std::fgets(buf, sizeof buf, f)) out += buf;
  ::pclose(f);
  return out;
}

// Why network namespaces cannot be used here, or "" if they can.
std::string NetnsUnavailable() {
  if (::geteuid() != 0) return "not root (uid " + std::to_string(::geteuid()) + ")";
  if (IpBin().empty()) return "ip (iproute2) is not installed";
  const std::string probe = "gfpprobe" + std::to_string(::getpid());
  if (Sh(IpBin() + " netns add " + probe + " 2>/dev/null") != 0) {
    return "ip netns add is refused here (no CAP_SYS_ADMIN?)";
  }
  Sh(IpBin() + " netns del " + probe);
  return "";
}

// Namespaces <tag>c (coordinator, bridge br0 at 10.217.0.254/16) and <tag>w<r> (worker r at
// 10.217.1.<r+1>), plus <tag>h in the root namespace (10.217.255.1) for the test's client.
// The destructor kills whatever still runs inside and deletes every namespace and link.
class Lab {
 public:
  explicit Lab(int workers) : ip_(IpBin()), tag_("gfp" + std::to_string(::getpid())) {
    try {
      Make(workers);
    } catch (...) {
      Cleanup();
      throw;
    }
  }
  ~Lab() { Cleanup(); }
  void Make(int workers) {
    auto must = [&](const std::string& args) {
      if (Sh(ip_ + " " + args) != 0) throw std::runtime_error("ip " + args + ": failed");
    };
    const std::string c = Ns();
    must("netns add " + c);
    made_.push_back(c);
    must("-n " + c + " link set lo up");
    must("-n " + c + " link add br0 type bridge");
    must("-n " + c + " addr add 10.217.0.254/16 dev br0");
    must("-n " + c + " link set br0 up");
    // The test's own link: <tag>h in the root namespace, its peer a bridge port.
    must("link add " + tag_ + "h type veth peer name " + tag_ + "hb");
    host_link_ = true;
    must("link set " + tag_ + "hb netns " + c);
    must("-n " + c + " link set " + tag_ + "hb master br0");
    must("-n " + c + " link set " + tag_ + "hb up");
    must("addr add 10.217.255.1/16 dev " + tag_ + "h");
    must("link set " + tag_ + "h up");
    for (int r = 0; r < workers; ++r) {
      const std::string ns = Ns(r);
      must("netns add " + ns);
      made_.push_back(ns);
      must("link add " + tag_ + "v" + std::to_string(r) + " type veth peer name " + tag_ + "b" +
           std::to_string(r));
      must("link set " + tag_ + "v" + std::to_string(r) + " netns " + ns);
      must("link set " + tag_ + "b" + std::to_string(r) + " netns " + c);
      must("-n " + ns + " link set lo up");
      must("-n " + ns + " link set " + tag_ + "v" + std::to_string(r) + " name eth0");
      must("-n " + ns + " addr add " + WorkerIp(r) + "/16 dev eth0");
      must("-n " + ns + " link set eth0 up");
      must("-n " + c + " link set " + tag_ + "b" + std::to_string(r) + " master br0");
      must("-n " + c + " link set " + tag_ + "b" + std::to_string(r) + " up");
    }
    workers_ = workers;
  }
  void Cleanup() {
    for (const auto& ns : made_) {
      for (const std::string& pid : Split(ShOut(ip_ + " netns pids " + ns + " 2>/dev/null"))) {
        ::kill(std::stoi(pid), SIGKILL);
      }
      Sh(ip_ + " netns del " + ns + " 2>/dev/null");
    }
    // Deleting a namespace deletes the veths in it, and with them their peers; the host link
    // may be left when the namespace was never made.
    if (host_link_) Sh(ip_ + " link del " + tag_ + "h 2>/dev/null");
    made_.clear();
    host_link_ = false;
  }
  const std::string& tag() const { return tag_; }
  std::string Ns() const { return tag_ + "c"; }
  std::string Ns(int r) const { return tag_ + "w" + std::to_string(r); }
  static std::string WorkerIp(int r) { return "10.217.1." + std::to_string(r + 1); }
  static std::string CoordinatorIp() { return "10.217.0.254"; }
  std::vector<std::string> Exec(const std::string& ns, std::vector<std::string> argv) const {
    argv.insert(argv.begin(), {ip_, "netns", "exec", ns});
    return argv;
  }
  // Cuts (or restores) coordinator <-> worker traffic both ways with blackhole routes; the
  // workers still reach each other across the bridge, and the test still reaches the
  // coordinator.
  void Partition(bool cut) {
    const std::string verb = cut ? "add" : "del";
    for (int r = 0; r < workers_; ++r) {
      Sh(ip_ + " -n " + Ns() + " route " + verb + " blackhole " + WorkerIp(r) + "/32");
      Sh(ip_ + " -n " + Ns(r) + " route " + verb + " blackhole " + CoordinatorIp() + "/32");
    }
  }
  // Namespaces and links named after `tag` that exist now.
  static std::string Leftovers(const std::string& tag) {
    return ShOut(IpBin() + " netns list 2>/dev/null | grep " + tag + "; " + IpBin() +
                 " -o link show 2>/dev/null | grep " + tag);
  }

 private:
  static std::vector<std::string> Split(const std::string& s) {
    std::vector<std::string> out;
    std::string cur;
    for (char ch : s) {
      if (std::isdigit(static_cast<unsigned char>(ch))) {
        cur += ch;
      } else if (!cur.empty()) {
        out.push_back(cur);
        cur.clear();
      }
    }
    if (!cur.empty()) out.push_back(cur);
    return out;
  }
  std::string ip_;
  std::string tag_;
  std::vector<std::string> made_;
  bool host_link_ = false;
  int workers_ = 0;
};

std::string Spec(const std::string& name) { return TinyJobSpec(name, kSteps, 11, kEvery, 2); }

// A worker in a namespace: its data directory (the mount namespace is shared) and process.
struct Daemon {
  std::unique_ptr<TempDir> dir;
  std::unique_ptr<ChildProcess> proc;
};

void RunPartition(Lab& lab) {
  TempDir coord_dir("geofp8-coord");
  ChildProcess coordinator(
      lab.Exec(lab.Ns(), {GEOFP8_COORDINATOR_BIN, "--listen", "0.0.0.0:0", "--metrics-listen", "",
                          "--data-dir", coord_dir.path(), "--tick-ms", "50"}));
  ASSERT_TRUE(coordinator.WaitFor("serving on", seconds(20))) << coordinator.output();
  const std::string out = coordinator.output();
  const size_t at = out.find("serving on 0.0.0.0:");
  ASSERT_NE(at, std::string::npos) << out;
  const int port = std::atoi(out.c_str() + at + std::string("serving on 0.0.0.0:").size());
  const std::string address = Lab::CoordinatorIp() + ":" + std::to_string(port);

  std::vector<Daemon> workers(2);
  for (int r = 0; r < 2; ++r) {
    workers[r].dir = std::make_unique<TempDir>("geofp8-worker");
    const std::string& d = workers[r].dir->path();
    workers[r].proc = std::make_unique<ChildProcess>(lab.Exec(
        lab.Ns(r), {GEOFP8_WORKER_BIN, "--coordinator", address, "--name", "w" + std::to_string(r),
                    "--metrics-port", "0", "--data-dir", d, "--ready-file", d + "/ready.json",
                    "--advertise-host", Lab::WorkerIp(r), "--debug-step-delay-ms",
                    std::to_string(kStepDelayMs)}));
  }
  auto describe = [&] {
    std::string s = "--- coordinator:\n" + coordinator.output();
    for (auto& w : workers) s += "\n--- worker:\n" + w.proc->output();
    return s;
  };
  auto result = [&](int r, const std::string& job, int attempt) {
    std::map<std::string, std::string> kv;
    std::ifstream in(workers[r].dir->path() + "/results/" + job + ".attempt" +
                     std::to_string(attempt) + ".txt");
    std::string line;
    while (std::getline(in, line)) {
      const size_t eq = line.find('=');
      if (eq != std::string::npos) kv[line.substr(0, eq)] = line.substr(eq + 1);
    }
    return kv;
  };

  Client client(address);
  ASSERT_TRUE(client.WaitIdle(2, seconds(30))) << describe();
  const v1::Job job = client.Submit(Spec("partition"));
  const v1::Job before = client.WaitStep(job.id(), 20, seconds(60));
  ASSERT_EQ(before.state(), v1::JOB_RUNNING) << describe();
  const int64_t recovery_point = before.progress().checkpoint_step();

  lab.Partition(true);
  const int64_t cut_ms = NowUnixMs();
  std::this_thread::sleep_for(seconds(kPartitionSeconds));
  // The coordinator must have declared the cut-off workers dead meanwhile.
  const v1::Job during = client.Get(job.id());
  lab.Partition(false);
  const int64_t restored_ms = NowUnixMs();
  EXPECT_EQ(during.attempt(), 1) << "the partition did not outlast the heartbeat timeout\n"
                                 << describe();

  const v1::Job done = client.WaitFinal(job.id(), seconds(90));
  ASSERT_EQ(done.state(), v1::JOB_SUCCEEDED) << done.reason() << "\n" << describe();

  int64_t dead_ms = 0, running_ms = 0, resumed_at = -1;
  for (const auto& e : done.events()) {
    if (!dead_ms && e.message().find("missed heartbeats") != std::string::npos) {
      dead_ms = e.unix_ms();
    }
    if (e.unix_ms() > restored_ms &&
        e.message().find("all 2 ranks reported progress") != std::string::npos) {
      running_ms = e.unix_ms();
    }
    const std::string key = "resuming from checkpoint step ";
    const size_t k = e.message().find(key);
    if (k != std::string::npos) resumed_at = std::stoll(e.message().substr(k + key.size()));
  }
  // Where the cut-off attempt stopped: both ranks stop together once they learn of the fence.
  const std::string stopped0 = result(0, job.id(), 0)["steps"];
  ASSERT_FALSE(stopped0.empty()) << describe();
  const int64_t stopped_at = std::stoll(stopped0);
  EXPECT_EQ(result(1, job.id(), 0)["steps"], stopped0);
  const int64_t redone = stopped_at - resumed_at;
  std::printf(
      "partition of %d s (coordinator <-> workers): progress %lld and recovery point %lld at the "
      "cut; declared dead %.2f s after the cut; attempt 0 stopped at step %lld; resumed from "
      "step %lld (%lld steps redone); running again %.2f s after the link returned\n",
      kPartitionSeconds, static_cast<long long>(before.progress().step()),
      static_cast<long long>(recovery_point), double(dead_ms - cut_ms) / 1000.0,
      static_cast<long long>(stopped_at), static_cast<long long>(resumed_at),
      static_cast<long long>(redone), double(running_ms - restored_ms) / 1000.0);
  EXPECT_GT(dead_ms, 0) << describe();
  // Nothing acknowledged lost: the resume point is at or past the one persisted before the cut.
  EXPECT_GE(resumed_at, recovery_point) << describe();
  // The ranks trained on through the partition; at most one checkpoint interval is redone.
  EXPECT_GE(stopped_at - recovery_point, 3 * kEvery) << describe();
  EXPECT_GE(redone, 0) << describe();
  EXPECT_LE(redone, kEvery) << describe();
  // Running again within 5 s of the link's return (issue #13's recovery target).
  EXPECT_GT(running_ms, 0) << describe();
  EXPECT_LT(double(running_ms - restored_ms) / 1000.0, 5.0) << describe();

  const std::string checksum = result(0, job.id(), done.attempt())["checksum"];
  EXPECT_EQ(checksum, result(1, job.id(), done.attempt())["checksum"]);
  EXPECT_EQ(checksum, FaultFreeChecksum(Spec("straight")));
}

TEST(PartitionFaultTest, CoordinatorCutOffPastTheHeartbeatTimeoutResumesWithTheSameChecksum) {
  const std::string why = NetnsUnavailable();
  if (!why.empty()) GTEST_SKIP() << "network namespaces unavailable: " << why;
  std::string tag;
  {
    Lab lab(2);
    tag = lab.tag();
    RunPartition(lab);
  }
  // Removed even when RunPartition failed part-way (the Lab's destructor).
  EXPECT_EQ(Lab::Leftovers(tag), "");
}

}  // namespace
}  // namespace geofp8::testing
