// geofp8ctl: the command-line client of the coordinator, in the kubectl manner
// (submit, get, describe, watch, policy, cancel). Every call carries a deadline.
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "CLI/CLI.hpp"
#include "client/ctl/render.h"
#include "geofp8/v1/geofp8.grpc.pb.h"
#include "kernels/policy/job_spec.h"
#include "kernels/policy/policy.h"

namespace geofp8::ctl {
namespace {

// Exit codes (docs/job-spec.md, "geofp8ctl"): distinct per failure class so scripts can branch.
enum Exit : int {
  kOk = 0,
  kFailure = 1,          // anything else, including a watched job that FAILED or was CANCELLED
  kUsage = 2,            // bad flags, unreadable or invalid local file
  kNotFound = 3,         // job or policy version does not exist
  kUnreachable = 4,      // server unavailable or deadline exceeded
  kRejected = 5,         // server refused the request (invalid spec, wrong state, key reuse)
  kUnauthenticated = 6,  // missing or wrong token, or TLS client identity refused
};

struct Globals {
  std::string server = "127.0.0.1:7070";
  std::string token;
  std::string tls_ca, tls_cert, tls_key;
  double timeout_s = 10;
  std::string output = "table";
};

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int Error(int code, const std::string& message) {
  std::fprintf(stderr, "geofp8ctl: error: %s\n", message.c_str());
  return code;
}

int FromStatus(const grpc::Status& s, const Globals& g) {
  switch (s.error_code()) {
    case grpc::StatusCode::NOT_FOUND:
      return Error(kNotFound, s.error_message());
    case grpc::StatusCode::UNAVAILABLE:
      return Error(kUnreachable, "server " + g.server + " unreachable: " + s.error_message());
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return Error(kUnreachable, "server " + g.server + " did not answer within " +
                                     std::to_string(g.timeout_s) + " s (--timeout)");
    case grpc::StatusCode::INVALID_ARGUMENT:
    case grpc::StatusCode::FAILED_PRECONDITION:
    case grpc::StatusCode::ALREADY_EXISTS:
    case grpc::StatusCode::OUT_OF_RANGE:
      return Error(kRejected, s.error_message());
    case grpc::StatusCode::UNAUTHENTICATED:
    case grpc::StatusCode::PERMISSION_DENIED:
      return Error(kUnauthenticated, s.error_message() + " (set --token or GEOFP8_TOKEN)");
    default:
      return Error(kFailure, s.error_message());
  }
}

// Largest file geofp8ctl reads (specs, patches, PEM files): a spec is a few KB, and a bound keeps
// `-f /dev/zero` or a wrong multi-GB path from hanging or exhausting memory.
constexpr size_t kMaxFileBytes = 4 << 20;

// Reads a regular file (or a pipe, or /dev/stdin) of at most kMaxFileBytes. Returns "" or the
// error line "FLAG: problem (PATH)".
std::string ReadFile(const std::string& flag, const std::string& path, std::string* out) {
  const int fd = path == "-" ? ::dup(STDIN_FILENO) : ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return flag + ": cannot read " + path + ": " + std::strerror(errno);
  struct stat st {};
  if (::fstat(fd, &st) == 0 && S_ISDIR(st.st_mode)) {
    ::close(fd);
    return flag + ": is a directory, expected a file (" + path + ")";
  }
  out->clear();
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::close(fd);
      return flag + ": cannot read " + path + ": " + std::strerror(err);
    }
    if (n == 0) break;
    if (out->size() + size_t(n) > kMaxFileBytes) {
      ::close(fd);
      return flag + ": larger than " + std::to_string(kMaxFileBytes >> 20) + " MiB (" + path + ")";
    }
    out->append(buf, size_t(n));
  }
  ::close(fd);
  return "";
}

// A PEM file must hold at least one block of `kind` ("CERTIFICATE", "PRIVATE KEY"); gRPC would
// otherwise fail the first call as "unreachable" (exit 4) instead of naming the file.
std::string ReadPem(const std::string& flag, const std::string& path, const std::string& kind,
                    std::string* out) {
  if (std::string e = ReadFile(flag, path, out); !e.empty()) return e;
  const size_t begin = out->find("-----BEGIN ");
  const size_t end = out->find("-----END ");
  if (begin == std::string::npos || end == std::string::npos || end < begin ||
      out->find(kind + "-----", begin) == std::string::npos) {
    return flag + ": not a PEM file with a " + kind + " block (" + path + ")";
  }
  return "";
}

class Client {
 public:
  explicit Client(const Globals& g) : g_(g) {}

  int Connect() {
    std::shared_ptr<grpc::ChannelCredentials> creds = grpc::InsecureChannelCredentials();
    if (!g_.tls_ca.empty() || !g_.tls_cert.empty()) {
      grpc::SslCredentialsOptions ssl;
      if (!g_.tls_ca.empty()) {
        std::string e = ReadPem("--tls-ca", g_.tls_ca, "CERTIFICATE", &ssl.pem_root_certs);
        if (!e.empty()) return Error(kUsage, e);
      }
      if (!g_.tls_cert.empty()) {
        if (g_.tls_key.empty()) return Error(kUsage, "--tls-key: required with --tls-cert");
        std::string e = ReadPem("--tls-cert", g_.tls_cert, "CERTIFICATE", &ssl.pem_cert_chain);
        if (!e.empty()) return Error(kUsage, e);
        e = ReadPem("--tls-key", g_.tls_key, "PRIVATE KEY", &ssl.pem_private_key);
        if (!e.empty()) return Error(kUsage, e);
      }
      creds = grpc::SslCredentials(ssl);
    }
    channel_ = grpc::CreateChannel(g_.server, creds);
    jobs_ = v1::JobService::NewStub(channel_);
    policies_ = v1::PolicyService::NewStub(channel_);
    workers_ = v1::WorkerService::NewStub(channel_);
    return kOk;
  }

  // A context with the deadline and the bearer token.
  std::unique_ptr<grpc::ClientContext> Context(bool with_deadline = true) const {
    auto ctx = std::make_unique<grpc::ClientContext>();
    if (with_deadline) {
      ctx->set_deadline(std::chrono::system_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(g_.timeout_s * 1000)));
    }
    if (!g_.token.empty()) ctx->AddMetadata("authorization", "Bearer " + g_.token);
    return ctx;
  }

  template <typename M>
  void Print(const M& m, const std::string& table) const {
    if (g_.output == "json") {
      std::cout << ToJson(m) << std::flush;
    } else if (g_.output == "yaml") {
      std::cout << ToYaml(m) << std::flush;
    } else {
      std::cout << table << std::flush;
    }
  }

  int Submit(const std::string& file, const std::string& key) {
    v1::SubmitJobRequest req;
    std::string spec;
    if (std::string e = ReadFile("-f", file, &spec); !e.empty()) return Error(kUsage, e);
    // gRPC strings must be UTF-8; say so here rather than have protobuf refuse the request.
    if (const size_t bad = InvalidUtf8At(spec); bad != std::string::npos) {
      return Error(kUsage, "-f: invalid UTF-8 at byte " + std::to_string(bad) + " (" + file + ")");
    }
    req.set_spec_yaml(spec);
    req.set_idempotency_key(key);
    v1::SubmitJobResponse resp;
    grpc::Status s = jobs_->SubmitJob(Context().get(), req, &resp);
    if (!s.ok()) return FromStatus(s, g_);
    Print(resp, "job/" + resp.job().id() +
                    (resp.created() ? " created" : " unchanged (idempotency key " + key + ")") +
                    " (" + StateName(resp.job().state()) + ")\n");
    return kOk;
  }

  int GetJobs(const std::vector<std::string>& states, int limit) {
    v1::ListJobsRequest req;
    for (const auto& name : states) {
      v1::JobState st;
      std::string upper = name;
      for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
      if (!v1::JobState_Parse("JOB_" + upper, &st) || st == v1::JOB_STATE_UNSPECIFIED) {
        return Error(kUsage, "--state: unknown state (" + name +
                                 "); accepted: pending, scheduled, running, succeeded, failed, "
                                 "cancelled");
      }
      req.add_states(st);
    }
    req.set_limit(limit);
    v1::ListJobsResponse resp;
    grpc::Status s = jobs_->ListJobs(Context().get(), req, &resp);
    if (!s.ok()) return FromStatus(s, g_);
    Print(resp, JobsTable({resp.jobs().begin(), resp.jobs().end()}, NowMs()));
    return kOk;
  }

  int GetJob(const std::string& id, bool describe) {
    v1::GetJobRequest req;
    req.set_job_id(id);
    v1::Job job;
    grpc::Status s = jobs_->GetJob(Context().get(), req, &job);
    if (!s.ok()) return FromStatus(s, g_);
    if (!describe) {
      Print(job, JobsTable({job}, NowMs()));
      return kOk;
    }
    v1::GetPolicyRequest preq;
    preq.set_job_id(id);
    v1::Policy policy;
    s = policies_->GetPolicy(Context().get(), preq, &policy);
    if (!s.ok()) return FromStatus(s, g_);
    Print(job, DescribeJob(job, &policy, NowMs()));
    return kOk;
  }

  int GetWorkers() {
    v1::ListWorkersResponse resp;
    grpc::Status s = workers_->ListWorkers(Context().get(), v1::ListWorkersRequest(), &resp);
    if (!s.ok()) return FromStatus(s, g_);
    Print(resp, WorkersTable(resp, NowMs()));
    return kOk;
  }

  int Cancel(const std::string& id, const std::string& reason) {
    v1::CancelJobRequest req;
    req.set_job_id(id);
    req.set_reason(reason);
    v1::Job job;
    grpc::Status s = jobs_->CancelJob(Context().get(), req, &job);
    if (!s.ok()) return FromStatus(s, g_);
    Print(job, "job/" + job.id() + " " + StateName(job.state()) + ": " + job.reason() + "\n");
    return kOk;
  }

  int PolicyGet(const std::string& id, uint64_t version) {
    v1::GetPolicyRequest req;
    req.set_job_id(id);
    req.set_version(version);
    v1::Policy p;
    grpc::Status s = policies_->GetPolicy(Context().get(), req, &p);
    if (!s.ok()) return FromStatus(s, g_);
    if (g_.output == "yaml") {
      // The patch-file schema, so that `policy get -o yaml | policy apply -f -` round-trips.
      auto file = PatchFileOf(p);
      if (!file.ok()) return Error(kRejected, std::string(file.status().message()));
      std::cout << WritePolicyPatch(
                       *file, "job/" + p.job_id() + " policy v" + std::to_string(p.version()) +
                                  ", effective at step " + std::to_string(p.effective_step()) +
                                  ", by " + p.author() +
                                  "\napply with: geofp8ctl policy apply " + p.job_id() +
                                  " -f FILE")
                << std::flush;
      return kOk;
    }
    Print(p, PolicyTable(p));
    return kOk;
  }

  int PolicyHistory(const std::string& id) {
    v1::ListPolicyVersionsRequest req;
    req.set_job_id(id);
    v1::ListPolicyVersionsResponse resp;
    grpc::Status s = policies_->ListPolicyVersions(Context().get(), req, &resp);
    if (!s.ok()) return FromStatus(s, g_);
    Print(resp, PolicyHistoryTable(resp));
    return kOk;
  }

  int PolicyUpdate(const std::string& id, const std::vector<LayerPatchSpec>& patches,
                   const std::optional<LayerPolicy>& defaults, const std::string& reason) {
    v1::UpdatePolicyRequest req;
    req.set_job_id(id);
    req.set_reason(reason);
    if (defaults) *req.mutable_default_policy() = ToProto(*defaults);
    for (const auto& p : patches) *req.add_patches() = ToProto(p);
    v1::UpdatePolicyResponse resp;
    grpc::Status s = policies_->UpdatePolicy(Context().get(), req, &resp);
    if (!s.ok()) return FromStatus(s, g_);
    const std::string version = "job/" + id + " policy v" + std::to_string(resp.policy().version());
    Print(resp, resp.unchanged()
                    ? version + " unchanged (the update matches the version in force)\n"
                    : version + " effective at step " +
                          std::to_string(resp.policy().effective_step()) + "\n");
    return kOk;
  }

  int Watch(const std::string& id) {
    // The stream itself is long-lived; the deadline bounds connecting and the first answer.
    const auto deadline = std::chrono::system_clock::now() +
                          std::chrono::milliseconds(static_cast<int64_t>(g_.timeout_s * 1000));
    if (!channel_->WaitForConnected(deadline)) {
      return Error(kUnreachable, "server " + g_.server + " unreachable within " +
                                     std::to_string(g_.timeout_s) + " s (--timeout)");
    }
    auto ctx = Context(false);
    v1::WatchJobRequest req;
    req.set_job_id(id);
    auto reader = jobs_->WatchJob(ctx.get(), req);
    v1::WatchJobResponse msg;
    const bool tty = isatty(STDOUT_FILENO) && g_.output == "table";
    bool have_first = false;
    int64_t first_step = 0;
    auto first_time = std::chrono::steady_clock::now();
    v1::Job last;
    bool drawn = false;
    while (reader->Read(&msg)) {
      last = msg.job();
      if (g_.output != "table") {
        Print(msg, "");
        if (g_.output == "yaml") std::cout << "---\n";
        continue;
      }
      const auto now = std::chrono::steady_clock::now();
      if (!have_first && last.state() == v1::JOB_RUNNING) {
        have_first = true;
        first_step = last.progress().step();
        first_time = now;
      }
      const double secs = std::chrono::duration<double>(now - first_time).count();
      const double rate = have_first && secs > 0 && last.progress().step() > first_step
                              ? (last.progress().step() - first_step) / secs
                              : 0.0;
      if (drawn && tty) std::cout << "\r\033[K";
      for (const auto& e : msg.events()) std::cout << e.message() << "\n";
      std::cout << ProgressLine(last, rate, 30);
      if (!tty) std::cout << "\n";
      std::cout << std::flush;
      drawn = true;
    }
    if (tty && drawn) std::cout << "\n";
    grpc::Status s = reader->Finish();
    if (!s.ok()) return FromStatus(s, g_);
    if (last.state() == v1::JOB_FAILED || last.state() == v1::JOB_CANCELLED) {
      return Error(kFailure, "job " + id + " " + StateName(last.state()) + ": " + last.reason());
    }
    return kOk;
  }

 private:
  const Globals& g_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::JobService::Stub> jobs_;
  std::unique_ptr<v1::PolicyService::Stub> policies_;
  std::unique_ptr<v1::WorkerService::Stub> workers_;
};

int Run(int argc, char** argv) {
  Globals g;
  if (const char* env = std::getenv("GEOFP8_SERVER"); env && *env) g.server = env;
  if (const char* env = std::getenv("GEOFP8_TOKEN"); env && *env) g.token = env;

  CLI::App app{"geofp8ctl: control GeoFP8 training jobs through the coordinator"};
  app.require_subcommand(1);
  app.footer(
      "Exit codes: 0 ok, 1 failure (or watched job failed/cancelled), 2 usage error, 3 not found,\n"
      "4 server unreachable or deadline exceeded, 5 rejected by the server, 6 unauthenticated.");
  app.add_option("-s,--server", g.server, "Coordinator address (env GEOFP8_SERVER)")
      ->capture_default_str();
  std::string token_flag, token_file;
  app.add_option("--token", token_flag,
                 "Bearer token for mutating calls (visible in ps: prefer --token-file or env "
                 "GEOFP8_TOKEN)");
  app.add_option("--token-file", token_file, "File whose first line is the bearer token");
  app.add_option("--tls-ca", g.tls_ca, "PEM CA that signed the server certificate (enables TLS)");
  app.add_option("--tls-cert", g.tls_cert, "PEM client certificate for mutual TLS");
  app.add_option("--tls-key", g.tls_key, "PEM key of --tls-cert");
  app.add_option("--timeout", g.timeout_s, "Deadline of each call, seconds")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 86400.0));
  app.add_option("-o,--output", g.output, "Output format")
      ->capture_default_str()
      ->check(CLI::IsMember({"table", "json", "yaml"}));
  app.fallthrough();

  std::string file, key, id, reason, layer;
  std::vector<std::string> states;
  int limit = 0;
  int64_t version = 0;  // signed: CLI11 would wrap -1 into 2^64-1

  auto* submit = app.add_subcommand("submit", "Submit a job spec (YAML)");
  submit->add_option("-f,--file", file, "Job spec file")->required();
  submit->add_option("--idempotency-key", key,
                     "Retries with the same key return the first job instead of a new one");

  auto* get = app.add_subcommand("get", "List or show resources");
  get->require_subcommand(1);
  auto* get_jobs = get->add_subcommand("jobs", "List jobs, newest first");
  get_jobs->add_option("--state", states, "Only these states (repeatable)");
  get_jobs->add_option("--limit", limit, "At most this many")->check(CLI::NonNegativeNumber);
  auto* get_job = get->add_subcommand("job", "Show one job");
  get_job->add_option("id", id, "Job id")->required();
  auto* get_workers = get->add_subcommand("workers", "List workers");

  auto* describe = app.add_subcommand("describe", "Show a job in detail: ranks, policy, events");
  describe->require_subcommand(1);
  auto* describe_job = describe->add_subcommand("job", "Describe one job");
  describe_job->add_option("id", id, "Job id")->required();

  auto* watch = app.add_subcommand("watch", "Follow a job with a live progress bar until it ends");
  watch->add_option("id", id, "Job id")->required();

  auto* cancel = app.add_subcommand("cancel", "Cancel a job");
  cancel->add_option("id", id, "Job id")->required();
  cancel->add_option("--reason", reason, "Why (recorded in the job's events)");

  auto* policy = app.add_subcommand("policy", "Show or change a job's compression policy");
  policy->require_subcommand(1);
  auto* policy_get = policy->add_subcommand("get", "Show a policy version (default: latest)");
  policy_get->add_option("id", id, "Job id")->required();
  policy_get->add_option("--version", version, "Version (0 = latest)");
  auto* policy_history = policy->add_subcommand("history", "List the policy versions");
  policy_history->add_option("id", id, "Job id")->required();
  auto* policy_set =
      policy->add_subcommand("set", "Patch the policy of the layers matching a glob");
  policy_set->add_option("id", id, "Job id")->required();
  policy_set->add_option("--layer", layer, "Layer name or glob, e.g. 'layers.*.attn.*'")
      ->required();
  std::string format, scaling, rounding, geometry, ef;
  std::optional<uint32_t> block;
  std::optional<int> rank, refresh;
  std::optional<float> alpha;
  policy_set->add_option("--format", format,
                         std::string("One of: ") + std::string(AcceptedFormatNames()));
  policy_set->add_option("--scaling", scaling,
                         std::string("One of: ") + std::string(AcceptedScalingNames()));
  policy_set->add_option("--block", block, "Elements per scale block");
  policy_set->add_option("--rounding", rounding,
                         std::string("One of: ") + std::string(AcceptedRoundingNames()));
  policy_set->add_option("--geometry", geometry,
                         std::string("One of: ") + std::string(AcceptedGeometryNames()));
  policy_set->add_option("--rank", rank, "Low-rank k");
  policy_set->add_option("--alpha", alpha, "Whitening exponent");
  policy_set->add_option("--error-feedback", ef, "on or off")->check(CLI::IsMember({"on", "off"}));
  policy_set->add_option("--refresh-interval", refresh, "Geometry refresh interval, steps");
  policy_set->add_option("--reason", reason, "Why (recorded with the version)");
  auto* policy_apply = policy->add_subcommand(
      "apply", "Apply a policy patch file (YAML; what `policy get -o yaml` prints)");
  policy_apply->add_option("id", id, "Job id")->required();
  policy_apply->add_option("-f,--file", file, "Patch file, or - for standard input")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "geofp8ctl: error: %s\n", e.what());
    std::fprintf(stderr, "run 'geofp8ctl --help' for usage\n");
    return kUsage;
  }
  if (!token_flag.empty()) {
    std::fprintf(stderr,
                 "geofp8ctl: warning: --token: other users can read it in the process list; use "
                 "--token-file or GEOFP8_TOKEN\n");
    g.token = token_flag;
  }
  if (!token_file.empty()) {
    std::string text;
    if (std::string e = ReadFile("--token-file", token_file, &text); !e.empty()) {
      return Error(kUsage, e);
    }
    g.token = text.substr(0, text.find_first_of("\r\n"));
    if (g.token.empty())
      return Error(kUsage, "--token-file: first line is empty (" + token_file + ")");
  }
  if (version < 0) {
    return Error(kUsage, "--version: must be >= 0, 0 = latest (" + std::to_string(version) + ")");
  }

  // Local validation before any network call: a usage error never needs the server.
  std::vector<LayerPatchSpec> patches;
  std::optional<LayerPolicy> defaults;
  if (*policy_set) {
    LayerPatchSpec p;
    p.match = layer;
    auto named = [&](const std::string& value, const char* flag, auto parse,
                     std::string_view accepted, auto* dst) -> bool {
      if (value.empty()) return true;
      auto v = parse(value);
      if (!v) {
        Error(kUsage, std::string(flag) + ": unknown value (" + value +
                          "); accepted: " + std::string(accepted));
        return false;
      }
      *dst = *v;
      return true;
    };
    if (!named(format, "--format", ParseFormatName, AcceptedFormatNames(), &p.format) ||
        !named(scaling, "--scaling", ParseScalingName, AcceptedScalingNames(), &p.scaling) ||
        !named(rounding, "--rounding", ParseRoundingName, AcceptedRoundingNames(), &p.rounding) ||
        !named(geometry, "--geometry", ParseGeometryName, AcceptedGeometryNames(), &p.geometry)) {
      return kUsage;
    }
    p.block = block;
    p.rank = rank;
    p.alpha = alpha;
    p.refresh_interval = refresh;
    if (!ef.empty()) p.error_feedback = ef == "on";
    if (!p.format && !p.scaling && !p.block && !p.rounding && !p.geometry && !p.rank && !p.alpha &&
        !p.error_feedback && !p.refresh_interval) {
      return Error(kUsage,
                   "policy set: give at least one of --format --scaling --block "
                   "--rounding --geometry --rank --alpha --error-feedback "
                   "--refresh-interval");
    }
    if (std::string e = ValidateLayerPatch(p, "--layer " + layer); !e.empty()) {
      return Error(kUsage, e);
    }
    patches.push_back(p);
  }
  if (*policy_apply) {
    std::string text;
    if (std::string e = ReadFile("-f", file, &text); !e.empty()) return Error(kUsage, e);
    auto parsed = ParsePolicyPatch(text);
    if (!parsed.ok()) return Error(kUsage, file + ": " + std::string(parsed.status().message()));
    patches = parsed->layers;
    defaults = parsed->defaults;
    reason = parsed->reason.empty() ? "applied " + file : parsed->reason;
  }

  Client client(g);
  if (int rc = client.Connect(); rc != kOk) return rc;
  if (*submit) return client.Submit(file, key);
  if (*get_jobs) return client.GetJobs(states, limit);
  if (*get_job) return client.GetJob(id, false);
  if (*get_workers) return client.GetWorkers();
  if (*describe_job) return client.GetJob(id, true);
  if (*watch) return client.Watch(id);
  if (*cancel) return client.Cancel(id, reason);
  if (*policy_get) return client.PolicyGet(id, version);
  if (*policy_history) return client.PolicyHistory(id);
  if (*policy_set || *policy_apply) return client.PolicyUpdate(id, patches, defaults, reason);
  return Error(kUsage, "no command given; run 'geofp8ctl --help'");
}

}  // namespace
}  // namespace geofp8::ctl

int main(int argc, char** argv) { return geofp8::ctl::Run(argc, argv); }
