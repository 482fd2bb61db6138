// Test helper: the "user program" of a `command:` job, written against worker/hook/hook_client.h
// as a training script would be. It records what it saw so that command_job_test can check it:
//   <out>/rank<R>.attempt<A>.env       the torchrun and GEOFP8_* environment, pid, cwd, and
//                                      whether the MASTER_ADDR:MASTER_PORT rendezvous worked
//   <out>/rank<R>.versions             "attempt step version" per step run (appended)
// Usage: hook_script --out DIR --steps N [--sleep-ms M] [--checkpoint-every K]
//                    [--exit-code C] [--layers-every L]
// Each step: PolicyDueAt(step) (the version in force), sleep, ReportStep; rank 0 sends a catalog
// and per-layer summaries; checkpoints are small files in GEOFP8_CHECKPOINT_DIR. Exits with C
// (default 0) after the last step, writing a line to stderr first when C != 0.
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

#include "platform/policy/policy.h"
#include "worker/hook/hook_client.h"

namespace {

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// Rank 0 listens on MASTER_PORT and accepts world-1 connections; the others connect to
// MASTER_ADDR:MASTER_PORT, as torch's TCPStore would. Returns the connections made/accepted.
int CheckMaster(int rank, int world) {
  const std::string host = Env("MASTER_ADDR");
  const int port = std::atoi(Env("MASTER_PORT").c_str());
  if (host.empty() || port <= 0) return -1;
  if (rank == 0) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(uint16_t(port));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 16) != 0) {
      std::fprintf(stderr, "cannot listen on MASTER_PORT %d: %s\n", port, std::strerror(errno));
      return -1;
    }
    int accepted = 0;
    for (; accepted < world - 1; ++accepted) {
      const int c = ::accept(fd, nullptr, nullptr);
      if (c < 0) break;
      ::close(c);
    }
    ::close(fd);
    return accepted;
  }
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return -1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int ok = 0;
  while (!ok && std::chrono::steady_clock::now() < deadline) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    if (::connect(fd, res->ai_addr, res->ai_addrlen) == 0) ok = 1;
    ::close(fd);
    if (!ok) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ::freeaddrinfo(res);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  std::string out;
  int64_t steps = 10, checkpoint_every = 0, layers_every = 5;
  int sleep_ms = 20, exit_code = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--out")
      out = v;
    else if (k == "--steps")
      steps = std::atoll(v.c_str());
    else if (k == "--sleep-ms")
      sleep_ms = std::atoi(v.c_str());
    else if (k == "--checkpoint-every")
      checkpoint_every = std::atoll(v.c_str());
    else if (k == "--exit-code")
      exit_code = std::atoi(v.c_str());
    else if (k == "--layers-every")
      layers_every = std::atoll(v.c_str());
    else {
      std::fprintf(stderr, "hook_script: unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  if (out.empty()) {
    std::fprintf(stderr, "hook_script: --out is required\n");
    return 2;
  }
  std::printf("hook_script: rank %s of %s starting\n", Env("RANK").c_str(),
              Env("WORLD_SIZE").c_str());
  std::fflush(stdout);
  auto hook = geofp8::hook::HookClient::FromEnvironment();
  if (!hook) {
    std::fprintf(stderr, "hook_script: GEOFP8_HOOK_ADDRESS is not set\n");
    return 3;
  }
  const int rank = hook->rank(), world = hook->world_size();
  const std::string tag = out + "/rank" + std::to_string(rank);
  {
    const int master = CheckMaster(rank, world);
    std::ofstream env(tag + ".attempt" + std::to_string(hook->attempt()) + ".env");
    for (const char* k : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                          "MASTER_PORT", "GEOFP8_COORDINATOR", "GEOFP8_JOB_ID", "GEOFP8_ATTEMPT",
                          "GEOFP8_TOKEN_FILE", "GEOFP8_HOOK_ADDRESS", "GEOFP8_RESUME_STEP",
                          "GEOFP8_CHECKPOINT_DIR", "CUDA_VISIBLE_DEVICES", "GEOFP8_DEVICE"}) {
      env << k << "=" << Env(k) << "\n";
    }
    env << "token_in_env=" << (std::getenv("GEOFP8_TOKEN") ? 1 : 0) << "\n";
    // What the token file is while the rank runs (the worker removes it when the rank ends).
    if (const char* tf = std::getenv("GEOFP8_TOKEN_FILE")) {
      struct stat st {};
      std::ifstream in(tf);
      std::string token;
      std::getline(in, token);
      env << "token_file_mode=" << (::stat(tf, &st) == 0 ? int(st.st_mode & 0777) : -1) << "\n";
      env << "token_file_token=" << token << "\n";
    }
    // A variable of the worker's own that is not on the documented list (the test sets it).
    env << "secret_in_env=" << (std::getenv("GEOFP8_TEST_WORKER_SECRET") ? 1 : 0) << "\n";
    env << "passed_in_env=" << (std::getenv("GEOFP8_TEST_PASSED") ? 1 : 0) << "\n";
    env << "path_in_env=" << (std::getenv("PATH") ? 1 : 0) << "\n";
    env << "pid=" << ::getpid() << "\ncwd=" << std::filesystem::current_path().string() << "\n";
    env << "master_connections=" << master << "\n";
  }
  if (!hook->WaitForPolicy(std::chrono::seconds(10))) {
    std::fprintf(stderr, "hook_script: no policy from the worker within 10 s\n");
    return 4;
  }
  const std::vector<geofp8::hook::LayerInfo> layers = {{"layers.0.w", 8, 8}, {"layers.0.b", 8, 1}};
  if (rank == 0) hook->SendCatalog(layers);
  std::ofstream versions(tag + ".versions", std::ios::app);
  for (int64_t step = hook->resume_step(); step < steps; ++step) {
    if (auto change = hook->PolicyDueAt(step)) {
      std::printf(
          "step %lld: policy v%llu (%s), layers.0.w format %s\n", (long long)step,
          (unsigned long long)change->version, change->reason.c_str(),
          change->layers.empty() ? "?" : geofp8::NameOf(change->layers[0].policy.format()).c_str());
      std::fflush(stdout);
    }
    versions << hook->attempt() << " " << step << " " << hook->version_in_force() << "\n";
    versions.flush();
    std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
    hook->ReportStep(step, 1.0 / double(step + 1), 1000.0, uint64_t(step + 1) * 100,
                     uint64_t(step + 1) * 400);
    if (rank == 0 && layers_every > 0 && step % layers_every == 0) {
      std::vector<geofp8::hook::LayerReport> reports;
      for (const auto& l : layers) reports.push_back({l.name, step, 0.01, 0.01, 0, 0.0});
      hook->ReportLayers(reports);
    }
    if (checkpoint_every > 0 && (step + 1) % checkpoint_every == 0) {
      const std::string path = hook->checkpoint_dir() + "/rank" + std::to_string(rank) + "." +
                               std::to_string(step + 1) + ".ckpt";
      std::ofstream(path) << step + 1 << "\n";
      hook->ReportCheckpoint(step + 1, path);
    }
  }
  if (exit_code != 0) {
    std::fprintf(stderr, "hook_script: failing on purpose with code %d\n", exit_code);
    return exit_code;
  }
  return 0;
}
