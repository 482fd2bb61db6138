// Test helper: geofp8-worker child processes against a CoordinatorProcess, plus a small gRPC
// client for the coordinator's job, policy and worker services.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "geofp8/v1/geofp8.grpc.pb.h"
#include "tests/worker/coordinator_process.h"

namespace geofp8::testing {

class WorkerProcess {
 public:
  WorkerProcess(const std::string& coordinator, const std::string& name,
                std::vector<std::string> extra = {})
      : dir_("geofp8-worker"), name_(name) {
    std::vector<std::string> argv = {GEOFP8_WORKER_BIN,
                                     "--coordinator",
                                     coordinator,
                                     "--name",
                                     name,
                                     "--metrics-port",
                                     "0",
                                     "--data-dir",
                                     dir_.path(),
                                     "--ready-file",
                                     dir_.path() + "/ready.json"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    proc_ = std::make_unique<ChildProcess>(argv);
  }
  const std::string& data_dir() const { return dir_.path(); }
  ChildProcess& process() { return *proc_; }
  // key=value lines of the result file of (job, attempt); empty map if absent.
  std::map<std::string, std::string> Result(const std::string& job, int attempt = 0) const {
    std::map<std::string, std::string> out;
    std::ifstream in(dir_.path() + "/results/" + job + ".attempt" + std::to_string(attempt) +
                     ".txt");
    std::string line;
    while (std::getline(in, line)) {
      const size_t eq = line.find('=');
      if (eq != std::string::npos) out[line.substr(0, eq)] = line.substr(eq + 1);
    }
    return out;
  }
  // From the worker's --ready-file ({"name": ..., "metrics": "127.0.0.1:PORT", "pid": N});
  // -1 until it is written.
  int MetricsPort() {
    std::ifstream in(dir_.path() + "/ready.json");
    std::stringstream text;
    text << in.rdbuf();
    const std::string key = "\"metrics\": \"127.0.0.1:";
    const size_t at = text.str().find(key);
    if (at == std::string::npos) return -1;
    return std::stoi(text.str().substr(at + key.size()));
  }

 private:
  TempDir dir_;
  std::string name_;
  std::unique_ptr<ChildProcess> proc_;
};

class Client {
 public:
  // token: sent as "authorization: Bearer <token>" on every call; empty: none.
  explicit Client(const std::string& address, std::string token = "")
      : channel_(grpc::CreateChannel(address, grpc::InsecureChannelCredentials())),
        jobs_(v1::JobService::NewStub(channel_)),
        policies_(v1::PolicyService::NewStub(channel_)),
        workers_(v1::WorkerService::NewStub(channel_)),
        token_(std::move(token)) {}

  std::unique_ptr<grpc::ClientContext> Ctx() const {
    auto c = std::make_unique<grpc::ClientContext>();
    c->set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    if (!token_.empty()) c->AddMetadata("authorization", "Bearer " + token_);
    return c;
  }
  v1::Job Submit(const std::string& yaml) {
    v1::SubmitJobRequest req;
    req.set_spec_yaml(yaml);
    v1::SubmitJobResponse resp;
    grpc::Status s = jobs_->SubmitJob(Ctx().get(), req, &resp);
    if (!s.ok()) throw std::runtime_error("SubmitJob: " + s.error_message());
    return resp.job();
  }
  v1::Job Get(const std::string& id) {
    v1::GetJobRequest req;
    req.set_job_id(id);
    v1::Job job;
    grpc::Status s = jobs_->GetJob(Ctx().get(), req, &job);
    if (!s.ok()) throw std::runtime_error("GetJob: " + s.error_message());
    return job;
  }
  // Polls until the job is final or `timeout` passes; returns the last snapshot.
  v1::Job WaitFinal(const std::string& id, std::chrono::seconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      v1::Job j = Get(id);
      if (j.state() == v1::JOB_SUCCEEDED || j.state() == v1::JOB_FAILED ||
          j.state() == v1::JOB_CANCELLED || std::chrono::steady_clock::now() > deadline) {
        return j;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  // Polls until the job reports a step >= step (or is final).
  v1::Job WaitStep(const std::string& id, int64_t step, std::chrono::seconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      v1::Job j = Get(id);
      if (j.progress().step() >= step || j.state() >= v1::JOB_SUCCEEDED ||
          std::chrono::steady_clock::now() > deadline) {
        return j;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  v1::Policy UpdatePolicy(const std::string& id, const v1::LayerPatch& patch,
                          const std::string& reason) {
    v1::UpdatePolicyRequest req;
    req.set_job_id(id);
    *req.add_patches() = patch;
    req.set_reason(reason);
    v1::UpdatePolicyResponse resp;
    grpc::Status s = policies_->UpdatePolicy(Ctx().get(), req, &resp);
    if (!s.ok()) throw std::runtime_error("UpdatePolicy: " + s.error_message());
    return resp.policy();
  }
  std::vector<v1::Worker> Workers() {
    v1::ListWorkersResponse resp;
    grpc::Status s = workers_->ListWorkers(Ctx().get(), v1::ListWorkersRequest(), &resp);
    if (!s.ok()) throw std::runtime_error("ListWorkers: " + s.error_message());
    return {resp.workers().begin(), resp.workers().end()};
  }
  // Waits until `n` workers are IDLE.
  bool WaitIdle(size_t n, std::chrono::seconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      size_t idle = 0;
      try {
        for (const auto& w : Workers()) idle += w.state() == v1::WORKER_IDLE;
      } catch (const std::exception&) {
        // A restarted coordinator: the channel reconnects on the next call.
      }
      if (idle >= n) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }

 private:
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::PolicyService::Stub> policies_;
  std::unique_ptr<v1::WorkerService::Stub> workers_;
  std::string token_;
};

// Everything a failure message needs: the job's events and every process's output.
inline std::string Describe(const v1::Job& job, CoordinatorProcess& c,
                            std::vector<WorkerProcess*> workers) {
  std::ostringstream os;
  os << "job " << job.id() << " state " << v1::JobState_Name(job.state()) << " reason '"
     << job.reason() << "'\n--- coordinator:\n"
     << c.process().output();
  for (auto* w : workers) os << "--- worker:\n" << w->process().output();
  return os.str();
}

}  // namespace geofp8::testing
