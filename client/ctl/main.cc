// geofp8ctl: the command-line client of the coordinator, in the kubectl manner
// (submit, get, describe, watch, policy, cancel, config, version, completion). Every call carries
// a deadline. Jobs are addressed by id or by name (resolved here through ListJobs).
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>

#include "CLI/CLI.hpp"
#include "client/ctl/config.h"
#include "client/ctl/doc.h"
#include "client/ctl/render.h"
#include "client/ctl/version.h"
#include "geofp8/v1/geofp8.grpc.pb.h"
#include "platform/policy/job_spec.h"
#include "platform/policy/policy.h"

namespace geofp8::ctl {
namespace {

// Exit codes (docs/job-spec.md, "geofp8ctl"): distinct per failure class so scripts can branch.
enum Exit : int {
  kOk = 0,
  kFailure = 1,          // anything else, including a watched job that FAILED or was CANCELLED
  kUsage = 2,            // bad flags, unreadable or invalid local file
  kNotFound = 3,         // job or policy version does not exist
  kUnreachable = 4,      // server unavailable or deadline exceeded
  kRejected = 5,         // server refused the request (invalid spec, wrong state, key reuse,
                         // a name a live job holds)
  kUnauthenticated = 6,  // missing or wrong token, or TLS client identity refused
  kStoreUnwritable = 7,  // the coordinator is up but cannot write its store (full, read-only)
};

// The status details the coordinator sets on a store that cannot be written
// (server/coordinator/store.h, kStoreUnwritableDetails): a wire value, matched by type.
constexpr char kStoreUnwritableDetails[] = "geofp8.store_unwritable";

struct Globals {
  std::string server = "127.0.0.1:7070";
  std::string token;
  std::string tls_ca, tls_cert, tls_key;
  double timeout_s = 10;
  std::string output = "table";  // table, wide, name, json, yaml or jsonpath
  std::string jsonpath;          // the template of -o jsonpath=...
  double watch_every = 10;       // watch, not a TTY: a line per this many % of the steps
  // Where the token came from ("--token-file /path", "env GEOFP8_TOKEN", ...); empty: none was
  // given. An UNAUTHENTICATED answer names it.
  std::string token_source;
};

// What an UNAUTHENTICATED answer adds: where the refused token came from, and every way to give
// one.
std::string TokenHint(const Globals& g) {
  const std::string ways =
      "give the coordinator's token with --token-file FILE, env GEOFP8_TOKEN or a context's "
      "token file (geofp8ctl config set-context NAME --server ADDRESS --token-file FILE, then "
      "--context NAME or config use-context NAME); --token TOKEN works too but shows in ps";
  if (g.token_source.empty()) return "; no token was given: " + ways;
  return "; the token from " + g.token_source + " was refused: " + ways;
}

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
  if (s.error_details() == kStoreUnwritableDetails) {
    return Error(
        kStoreUnwritable,
        "server " + g.server + " cannot record anything now (its store): " + s.error_message());
  }
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
      return Error(kUnauthenticated, s.error_message() + TokenHint(g));
    default:
      return Error(kFailure, s.error_message());
  }
}

// Largest file geofp8ctl reads (specs, patches, PEM files): a spec is a few KB, and a bound keeps
// `-f /dev/zero` or a wrong multi-GB path from hanging or exhausting memory.
constexpr size_t kMaxFileBytes = 4 << 20;
// Jobs or workers asked for per page of a listing (the server's bound is 1000).
constexpr int kListPageSize = 500;

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

// A whole number >= 0, refused as `--flag: must be a whole number >= 0 (-1)`. CLI11's
// NonNegativeNumber names its range as 0 to DBL_MAX, printed with all 309 digits.
const CLI::Validator kNonNegative(
    [](std::string& value) -> std::string {
      int64_t v = -1;
      return CLI::detail::lexical_cast(value, v) && v >= 0
                 ? std::string()
                 : "must be a whole number >= 0 (" + value + ")";
    },
    "NONNEGATIVE");

// `logs`' flags, kubectl's conventions (docs/logs.md).
struct LogsFlags {
  int rank = 0;
  int attempt = -1;  // -1: the newest attempt
  bool follow = false;
  int tail = -1;  // -1: everything
  bool stderr_stream = false;
};

CLI::App* AddLogsCommand(CLI::App& app, std::string* id, LogsFlags* f) {
  auto* logs = app.add_subcommand(
      "logs", "Print a command job's rank output (stdout, or --stderr), read from its worker");
  logs->add_option("job", *id, "Job id or name")->required();
  logs->add_option("--rank", f->rank, "Rank")->capture_default_str()->check(kNonNegative);
  logs->add_option("--attempt", f->attempt, "Attempt (0 is the first; default: the newest)")
      ->check(kNonNegative);
  logs->add_flag("-f,--follow", f->follow,
                 "Keep printing what the rank writes until it ends; without --attempt, go on "
                 "into the next attempt's output when the job restarts (saying so on stderr), "
                 "until the job is final (Ctrl-C stops)");
  logs->add_option("--tail", f->tail, "Only the last N lines (-1: all)")
      ->capture_default_str()
      ->check(CLI::Range(-1, 1 << 30));
  logs->add_flag("--stderr", f->stderr_stream, "The rank's stderr instead of its stdout");
  return logs;
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

  // Prints m in the -o format: table (or `wide`, when given), name (`names`, one a line), or
  // json, yaml, jsonpath of the message.
  int Print(const google::protobuf::Message& m, const std::string& table,
            const std::string& wide = "", const std::string& names = "") const {
    if (g_.output == "json") {
      std::cout << ToJson(m);
    } else if (g_.output == "yaml") {
      std::cout << ToYaml(m);
    } else if (g_.output == "jsonpath") {
      // As kubectl: the template's text only, no newline of ours ({"\n"} adds one).
      auto text = JsonPath(OutputDoc(m), g_.jsonpath);
      if (!text.ok()) return Error(kUsage, "-o " + std::string(text.status().message()));
      std::cout << *text;
    } else if (g_.output == "name") {
      std::cout << names;
    } else if (g_.output == "wide" && !wide.empty()) {
      std::cout << wide;
    } else {
      std::cout << table;
    }
    std::cout << std::flush;
    return kOk;
  }

  // A job by id or, failing that, by name (ListJobs): the newest job of that name (names are
  // unique among unfinished jobs, so that is the live one when there is one). `job` gets the job
  // when it was fetched.
  int Resolve(const std::string& ref, std::string* id, v1::Job* job = nullptr) {
    v1::GetJobRequest req;
    req.set_job_id(ref);
    v1::Job found;
    grpc::Status s = jobs_->GetJob(Context().get(), req, &found);
    if (s.ok()) {
      *id = ref;
      if (job) *job = found;
      return kOk;
    }
    if (s.error_code() != grpc::StatusCode::NOT_FOUND) return FromStatus(s, g_);
    // ListJobs answers newest first, a page at a time: the first job of that name is the one.
    v1::ListJobsRequest list;
    list.set_name(ref);
    list.set_page_size(1);
    std::optional<std::string> newest;
    do {
      v1::ListJobsResponse page;
      s = jobs_->ListJobs(Context().get(), list, &page);
      if (!s.ok()) return FromStatus(s, g_);
      for (const auto& j : page.jobs()) {
        if (j.name() == ref) {
          newest = j.id();
          break;
        }
      }
      list.set_page_token(page.next_page_token());
    } while (!newest && !list.page_token().empty());
    if (!newest) return Error(kNotFound, "job " + ref + " not found (no job has this id or name)");
    *id = *newest;
    if (!job) return kOk;
    req.set_job_id(*id);
    s = jobs_->GetJob(Context().get(), req, job);
    return s.ok() ? kOk : FromStatus(s, g_);
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
    const std::string line =
        "job/" + resp.job().id() +
        (resp.created() ? " created" : " unchanged (idempotency key " + key + ")") + " (" +
        StateName(resp.job().state()) + ")\n";
    return Print(resp, line, "", "job/" + resp.job().id() + "\n");
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
    // Page by page (each under gRPC's message limit), printed as one list; --limit stops early.
    v1::ListJobsResponse resp;
    do {
      const int left = limit > 0 ? limit - resp.jobs_size() : kListPageSize;
      req.set_page_size(std::min(left, kListPageSize));
      v1::ListJobsResponse page;
      grpc::Status s = jobs_->ListJobs(Context().get(), req, &page);
      if (!s.ok()) return FromStatus(s, g_);
      for (auto& j : *page.mutable_jobs()) *resp.add_jobs() = std::move(j);
      req.set_page_token(page.next_page_token());
    } while (!req.page_token().empty() && (limit == 0 || resp.jobs_size() < limit));
    const std::vector<v1::Job> jobs(resp.jobs().begin(), resp.jobs().end());
    std::string names;
    for (const auto& j : jobs) names += "job/" + j.id() + "\n";
    return Print(resp, JobsTable(jobs, NowMs()), JobsWideTable(jobs, NowMs()), names);
  }

  int GetJob(const std::string& ref, bool describe) {
    std::string id;
    v1::Job job;
    if (int rc = Resolve(ref, &id, &job); rc != kOk) return rc;
    if (!describe) {
      return Print(job, JobsTable({job}, NowMs()), JobsWideTable({job}, NowMs()),
                   "job/" + id + "\n");
    }
    v1::GetPolicyRequest preq;
    preq.set_job_id(id);
    v1::Policy policy;
    grpc::Status s = policies_->GetPolicy(Context().get(), preq, &policy);
    if (!s.ok()) return FromStatus(s, g_);
    return Print(job, DescribeJob(job, &policy, NowMs()));
  }

  int GetWorkers() {
    v1::ListWorkersResponse resp;
    v1::ListWorkersRequest req;
    req.set_page_size(kListPageSize);
    do {
      v1::ListWorkersResponse page;
      grpc::Status s = workers_->ListWorkers(Context().get(), req, &page);
      if (!s.ok()) return FromStatus(s, g_);
      for (auto& w : *page.mutable_workers()) *resp.add_workers() = std::move(w);
      req.set_page_token(page.next_page_token());
    } while (!req.page_token().empty());
    std::string names;
    for (const auto& w : resp.workers()) names += "worker/" + w.id() + "\n";
    return Print(resp, WorkersTable(resp, NowMs()), WorkersWideTable(resp, NowMs()), names);
  }

  int Cancel(const std::string& ref, const std::string& reason) {
    std::string id;
    if (int rc = Resolve(ref, &id); rc != kOk) return rc;
    v1::CancelJobRequest req;
    req.set_job_id(id);
    req.set_reason(reason);
    v1::Job job;
    grpc::Status s = jobs_->CancelJob(Context().get(), req, &job);
    if (!s.ok()) return FromStatus(s, g_);
    return Print(job, "job/" + job.id() + " " + StateName(job.state()) + ": " + job.reason() + "\n",
                 "", "job/" + job.id() + "\n");
  }

  // kubectl's `delete`: "job/ID deleted"; the server refuses a job that is not finished. A name
  // reaches only the newest job ever submitted with it: once that one is deleted, the server
  // refuses (NOT_FOUND) rather than delete an older job of the name, which only its id reaches.
  int Delete(const std::string& ref) {
    v1::GetJobRequest get;
    get.set_job_id(ref);
    v1::Job found;
    grpc::Status s = jobs_->GetJob(Context().get(), get, &found);
    if (!s.ok() && s.error_code() != grpc::StatusCode::NOT_FOUND) return FromStatus(s, g_);
    v1::DeleteJobRequest req;
    if (s.ok()) {
      req.set_job_id(ref);
    } else {
      req.set_name(ref);
    }
    v1::DeleteJobResponse resp;
    s = jobs_->DeleteJob(Context().get(), req, &resp);
    if (!s.ok()) return FromStatus(s, g_);
    const std::string id = resp.job().id();
    return Print(resp, "job/" + id + " deleted\n", "", "job/" + id + "\n");
  }

  int PolicyGet(const std::string& ref, uint64_t version) {
    std::string id;
    if (int rc = Resolve(ref, &id); rc != kOk) return rc;
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
                                  ", by " + p.author() + "\napply with: geofp8ctl policy apply " +
                                  p.job_id() + " -f FILE")
                << std::flush;
      return kOk;
    }
    return Print(p, PolicyTable(p));
  }

  int PolicyHistory(const std::string& ref) {
    std::string id;
    if (int rc = Resolve(ref, &id); rc != kOk) return rc;
    // Page by page (each under gRPC's message limit), printed as one list.
    v1::ListPolicyVersionsRequest req;
    req.set_job_id(id);
    v1::ListPolicyVersionsResponse all;
    do {
      v1::ListPolicyVersionsResponse page;
      grpc::Status s = policies_->ListPolicyVersions(Context().get(), req, &page);
      if (!s.ok()) return FromStatus(s, g_);
      for (auto& p : *page.mutable_policies()) *all.add_policies() = std::move(p);
      req.set_page_token(page.next_page_token());
    } while (!req.page_token().empty());
    return Print(all, PolicyHistoryTable(all), PolicyHistoryWideTable(all, NowMs()));
  }

  int PolicyUpdate(const std::string& ref, const std::vector<LayerPatchSpec>& patches,
                   const std::optional<LayerPolicy>& defaults, const std::string& reason) {
    std::string id;
    if (int rc = Resolve(ref, &id); rc != kOk) return rc;
    v1::UpdatePolicyRequest req;
    req.set_job_id(id);
    req.set_reason(reason);
    if (defaults) *req.mutable_default_policy() = ToProto(*defaults);
    for (const auto& p : patches) *req.add_patches() = ToProto(p);
    v1::UpdatePolicyResponse resp;
    grpc::Status s = policies_->UpdatePolicy(Context().get(), req, &resp);
    if (!s.ok()) return FromStatus(s, g_);
    const std::string version = "job/" + id + " policy v" + std::to_string(resp.policy().version());
    return Print(resp, resp.unchanged()
                           ? version + " unchanged (the update matches the version in force)\n"
                           : version + " effective at step " +
                                 std::to_string(resp.policy().effective_step()) + "\n");
  }

  // Before a long-lived stream (watch, logs -f), which has no deadline: connects within --timeout,
  // then resolves `ref` as Resolve does.
  int ResolveForStream(const std::string& ref, std::string* id) {
    const auto deadline = std::chrono::system_clock::now() +
                          std::chrono::milliseconds(static_cast<int64_t>(g_.timeout_s * 1000));
    if (!channel_->WaitForConnected(deadline)) {
      return Error(kUnreachable, "server " + g_.server + " unreachable within " +
                                     std::to_string(g_.timeout_s) + " s (--timeout)");
    }
    return Resolve(ref, id);
  }

  // The rank's output as it is, on stdout; -o does not apply (it is the program's text). With
  // -f and no --attempt it follows the job, not one attempt: when the attempt ends and the job
  // restarts it says so on stderr and goes on with the next attempt's output, until the job is
  // final.
  int Logs(const std::string& ref, const LogsFlags& f) {
    if (g_.output != "table") {
      return Error(kUsage, "-o: not for logs (it prints the program's output as it is)");
    }
    std::string id;
    if (int rc = ResolveForStream(ref, &id); rc != kOk) return rc;
    if (f.tail == 0) return kOk;  // kubectl: --tail 0 prints nothing
    if (!f.follow || f.attempt >= 0) {
      const grpc::Status s =
          StreamLog(id, f, f.attempt >= 0 ? std::optional<int>(f.attempt) : std::nullopt, f.tail);
      return s.ok() ? kOk : FromStatus(s, g_);
    }
    // The attempt to follow: the job's, or while a restart waits to be placed the one before
    // it; a job not placed yet is waited for. Unset (the newest placed, as the coordinator knows
    // it) for a final job.
    v1::Job job;
    v1::GetJobRequest get;
    get.set_job_id(id);
    if (grpc::Status s = jobs_->GetJob(Context().get(), get, &job); !s.ok()) {
      return FromStatus(s, g_);
    }
    if (job.state() == v1::JOB_PENDING && job.attempt() == 0) {
      if (int rc = WaitForNextAttempt(id, -1, &job); rc != kOk) return rc;
    }
    std::optional<int> attempt;
    if (!IsFinal(job.state())) {
      attempt = job.state() == v1::JOB_PENDING ? job.attempt() - 1 : job.attempt();
    }
    int tail = f.tail;
    for (bool first = true;; first = false) {
      const grpc::Status s = StreamLog(id, f, attempt, tail);
      // A later attempt that was never placed (cancelled while pending): nothing to print.
      const bool never_placed = !first && s.error_code() == grpc::StatusCode::FAILED_PRECONDITION;
      if (!s.ok() && !never_placed) return FromStatus(s, g_);
      tail = -1;  // the next attempts' output whole
      const int done = attempt.value_or(job.attempt());
      if (int rc = WaitForNextAttempt(id, done, &job); rc != kOk) return rc;
      if (job.attempt() <= done) return kOk;  // final, with no restart after `done`
      // The reason the job recorded when it restarted: only the newest restart's is at hand.
      const std::string why =
          done + 1 == job.attempt() ? " (" + RestartReason(id, job) + ")" : std::string();
      std::fprintf(stderr, "geofp8ctl: job %s attempt %d ended%s; following attempt %d\n",
                   id.c_str(), done, why.c_str(), done + 1);
      std::fflush(stderr);
      attempt = done + 1;
    }
  }

  // One attempt's output (the newest placed when `attempt` is unset) on stdout until the server
  // ends the stream: at its end, or with -f when the rank has ended and its output is drained.
  grpc::Status StreamLog(const std::string& id, const LogsFlags& f, std::optional<int> attempt,
                         int tail) {
    v1::LogsRequest req;
    req.set_job_id(id);
    req.set_rank(f.rank);
    if (attempt) req.set_attempt(*attempt);
    req.set_follow(f.follow);
    req.set_tail_lines(std::max(tail, 0));
    req.set_stream(f.stderr_stream ? v1::LOG_STDERR : v1::LOG_STDOUT);
    // A long file or -f outlives any deadline; the server ends the stream.
    auto ctx = Context(false);
    auto reader = jobs_->Logs(ctx.get(), req);
    v1::LogsChunk chunk;
    while (reader->Read(&chunk)) {
      std::fwrite(chunk.data().data(), 1, chunk.data().size(), stdout);
      std::fflush(stdout);
    }
    return reader->Finish();
  }

  // Why the job restarted last: its newest PENDING event ("...; restart 1/3 from checkpoint
  // step 40"), else its reason.
  std::string RestartReason(const std::string& id, const v1::Job& job) {
    v1::GetJobRequest get;
    get.set_job_id(id);
    v1::Job full;
    if (jobs_->GetJob(Context().get(), get, &full).ok()) {
      for (auto e = full.events().rbegin(); e != full.events().rend(); ++e) {
        if (e->state() != v1::JOB_PENDING) continue;
        const std::string prefix = "PENDING: ";  // the event names its state first
        const std::string& m = e->message();
        return m.rfind(prefix, 0) == 0 ? m.substr(prefix.size()) : m;
      }
    }
    return job.reason();
  }

  static bool IsFinal(v1::JobState state) {
    return state == v1::JOB_SUCCEEDED || state == v1::JOB_FAILED || state == v1::JOB_CANCELLED;
  }

  // After `attempt`'s rank output ended (-1: before the first): watches the job until it is
  // final, or attempt + 1 has been placed (its ranks assigned) or has ended already (a later one
  // exists), leaving that snapshot in `job`.
  int WaitForNextAttempt(const std::string& id, int attempt, v1::Job* job) {
    auto ctx = Context(false);
    v1::WatchJobRequest req;
    req.set_job_id(id);
    auto reader = jobs_->WatchJob(ctx.get(), req);
    v1::WatchJobResponse msg;
    while (reader->Read(&msg)) {
      *job = msg.job();
      const bool placed = job->ranks_size() > 0 &&
                          (job->state() == v1::JOB_SCHEDULED || job->state() == v1::JOB_RUNNING);
      if (IsFinal(job->state()) || job->attempt() > attempt + 1 ||
          (job->attempt() == attempt + 1 && placed)) {
        break;
      }
    }
    ctx->TryCancel();
    grpc::Status s = reader->Finish();
    if (!s.ok() && s.error_code() != grpc::StatusCode::CANCELLED) return FromStatus(s, g_);
    return kOk;
  }

  // On a TTY: one status line redrawn in place (at most 10 times a second), events above it.
  // Otherwise: events, and the status line on every state change and every --every % of steps.
  // -o json|yaml|jsonpath: every update, as documents.
  int Watch(const std::string& ref) {
    std::string id;
    if (int rc = ResolveForStream(ref, &id); rc != kOk) return rc;
    auto ctx = Context(false);
    v1::WatchJobRequest req;
    req.set_job_id(id);
    auto reader = jobs_->WatchJob(ctx.get(), req);
    v1::WatchJobResponse msg;
    const bool structured = g_.output == "json" || g_.output == "yaml" || g_.output == "jsonpath";
    const bool tty = !structured && isatty(STDOUT_FILENO);
    const auto start = std::chrono::steady_clock::now();
    StepRate rate;  // steps/s over the last 30 s; no ETA before 5 s of progress
    WatchThrottle throttle(g_.watch_every);
    v1::Job last;
    bool drawn = false;
    double last_draw = -1;
    v1::JobState drawn_state = v1::JOB_STATE_UNSPECIFIED;
    std::string pending;  // TTY: the newest line not drawn yet
    while (reader->Read(&msg)) {
      last = msg.job();
      if (structured) {
        if (int rc = Print(msg, ""); rc != kOk) return rc;
        if (g_.output == "yaml") std::cout << "---\n" << std::flush;
        continue;
      }
      const double now =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (last.state() == v1::JOB_RUNNING) rate.Add(now, StepsDone(last));
      const std::string line = ProgressLine(last, rate.Rate(), 30);
      if (!tty) {
        for (const auto& e : msg.events()) std::cout << e.message() << "\n";
        if (throttle.ShouldPrint(last)) std::cout << line << "\n";
        std::cout << std::flush;
        continue;
      }
      const bool news = msg.events_size() > 0 || last.state() != drawn_state;
      if (!news && drawn && now - last_draw < 0.1) {
        pending = line;
        continue;
      }
      if (drawn) std::cout << "\r\033[K";
      for (const auto& e : msg.events()) std::cout << e.message() << "\n";
      std::cout << line << std::flush;
      pending.clear();
      drawn = true;
      last_draw = now;
      drawn_state = last.state();
    }
    if (tty && !pending.empty()) std::cout << "\r\033[K" << pending;
    if (tty && drawn) std::cout << "\n" << std::flush;
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

// The command tree for `completion`, read off the CLI11 app.
CommandNode Tree(const CLI::App& app) {
  CommandNode n;
  n.name = app.get_name();
  for (const CLI::Option* o : app.get_options()) {
    if (!o->nonpositional()) {
      n.takes_job = n.takes_job || o->get_name() == "job";
      continue;
    }
    const bool value = o->get_type_size_max() > 0;
    for (const auto& l : o->get_lnames()) n.options.emplace_back("--" + l, value);
    for (const auto& sn : o->get_snames()) n.options.emplace_back("-" + sn, value);
  }
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    n.children.push_back(Tree(*sub));
  }
  return n;
}

std::string SubcommandNames(const CLI::App& app) {
  std::string out;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    out += (out.empty() ? "" : ", ") + sub->get_name();
  }
  return out;
}

// Before CLI11 parses: an unknown command says so by name with the list (kubectl's wording), and
// a command that needs a subcommand and has none lists them. Returns -1 to go on parsing.
int CheckCommands(CLI::App& app, int argc, char** argv) {
  CLI::App* cur = &app;
  std::string path = "geofp8ctl";
  bool skip = false;
  bool positional_seen = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (skip) {
      skip = false;
      continue;
    }
    if (a == "--") break;
    if (a.size() > 1 && a[0] == '-') {
      if (a.find('=') != std::string::npos) continue;
      // An option of this command or a parent (options fall through) that takes a value.
      for (CLI::App* c = cur; c; c = c->get_parent()) {
        const CLI::Option* o = c->get_option_no_throw(a);
        if (o) {
          skip = o->get_type_size_max() > 0;
          break;
        }
      }
      continue;
    }
    const auto subs = cur->get_subcommands([](const CLI::App*) { return true; });
    if (subs.empty()) {
      positional_seen = true;
      continue;  // a positional of a leaf command
    }
    CLI::App* next = nullptr;
    for (CLI::App* sub : subs) {
      if (sub->check_name(a)) next = sub;
    }
    if (!next) {
      if (positional_seen) continue;
      std::fprintf(stderr, "geofp8ctl: error: unknown command \"%s\" for \"%s\"\n", a.c_str(),
                   path.c_str());
      std::fprintf(stderr, "available commands: %s\nrun '%s --help' for usage\n",
                   SubcommandNames(*cur).c_str(), path.c_str());
      return kUsage;
    }
    cur = next;
    path += " " + a;
  }
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") return -1;
  }
  if (cur != &app && cur->get_require_subcommand_min() > 0) {
    std::fprintf(stderr, "geofp8ctl: error: %s: a subcommand is required: %s\n", path.c_str(),
                 SubcommandNames(*cur).c_str());
    std::fprintf(stderr, "run '%s --help' for usage\n", path.c_str());
    return kUsage;
  }
  return -1;
}

// -o VALUE: table, wide, name, json, yaml, jsonpath=TEMPLATE (also jsonpath='{...}').
std::string ParseOutput(const std::string& value, Globals* g) {
  static const char* kAccepted = "table, wide, name, json, yaml, jsonpath=TEMPLATE";
  if (value == "table" || value == "wide" || value == "name" || value == "json" ||
      value == "yaml") {
    g->output = value;
    return "";
  }
  if (value.rfind("jsonpath=", 0) == 0) {
    g->output = "jsonpath";
    g->jsonpath = value.substr(9);
    if (g->jsonpath.size() >= 2 && g->jsonpath.front() == '\'' && g->jsonpath.back() == '\'') {
      g->jsonpath = g->jsonpath.substr(1, g->jsonpath.size() - 2);
    }
    // The template's syntax now: a usage error needs no server.
    if (auto st = CheckJsonPath(g->jsonpath); !st.ok()) return "-o: " + std::string(st.message());
    return "";
  }
  return "-o: unknown output format (" + value + "); accepted: " + kAccepted;
}

int ConfigCommand(const std::string& what, Config config, const std::string& name,
                  const Context& given, const Globals& g) {
  if (what == "current-context") {
    if (config.current_context.empty()) {
      return Error(kFailure, "current-context is not set in " + config.path +
                                 " (geofp8ctl config use-context NAME)");
    }
    std::cout << config.current_context << "\n";
    return kOk;
  }
  if (what == "get-contexts") {
    if (g.output == "name") {
      for (const auto& c : config.contexts) std::cout << c.name << "\n";
      return kOk;
    }
    if (g.output == "json" || g.output == "yaml" || g.output == "jsonpath") {
      Doc root = Doc::Object();
      root.Add("current-context", Doc::String(config.current_context));
      Doc list = Doc::Array();
      for (const auto& c : config.contexts) {
        Doc d = Doc::Object();
        d.Add("name", Doc::String(c.name));
        d.Add("server", Doc::String(c.server));
        d.Add("token-file", Doc::String(c.token_file));
        d.Add("ca", Doc::String(c.ca));
        d.Add("cert", Doc::String(c.cert));
        d.Add("key", Doc::String(c.key));
        list.items.push_back(std::move(d));
      }
      root.Add("contexts", std::move(list));
      if (g.output == "json") std::cout << DocToJson(root);
      if (g.output == "yaml") std::cout << DocToYaml(root);
      if (g.output == "jsonpath") {
        auto text = JsonPath(root, g.jsonpath);
        if (!text.ok()) return Error(kUsage, "-o " + std::string(text.status().message()));
        std::cout << *text;
      }
      return kOk;
    }
    std::vector<std::vector<std::string>> rows = {
        {"CURRENT", "NAME", "SERVER", "TOKEN-FILE", "CA", "CERT"}};
    for (const auto& c : config.contexts) {
      rows.push_back({c.name == config.current_context ? "*" : "", c.name, c.server,
                      c.token_file.empty() ? "-" : c.token_file, c.ca.empty() ? "-" : c.ca,
                      c.cert.empty() ? "-" : c.cert});
    }
    std::cout << Table(rows);
    return kOk;
  }
  if (what == "use-context") {
    if (!config.Find(name)) {
      std::string known;
      for (const auto& c : config.contexts) known += (known.empty() ? "" : ", ") + c.name;
      return Error(kNotFound, "use-context: no context named " + name + " in " + config.path +
                                  " (contexts: " + (known.empty() ? "none" : known) + ")");
    }
    config.current_context = name;
    if (auto st = SaveConfig(config); !st.ok()) return Error(kFailure, std::string(st.message()));
    std::cout << "switched to context \"" << name << "\" (" << config.path << ")\n";
    return kOk;
  }
  // set-context: create or update; file paths are stored absolute.
  auto absolute = [](const std::string& f) {
    if (f.empty() || f[0] == '/' || f[0] == '~') return f;
    std::error_code ec;
    auto p = std::filesystem::absolute(f, ec);
    return ec ? f : p.lexically_normal().string();
  };
  Context* ctx = config.Find(name);
  const bool created = ctx == nullptr;
  if (created) {
    config.contexts.push_back(Context{name, "", "", "", "", ""});
    ctx = &config.contexts.back();
  }
  if (!given.server.empty()) ctx->server = given.server;
  if (!given.token_file.empty()) ctx->token_file = absolute(given.token_file);
  if (!given.ca.empty()) ctx->ca = absolute(given.ca);
  if (!given.cert.empty()) ctx->cert = absolute(given.cert);
  if (!given.key.empty()) ctx->key = absolute(given.key);
  if (ctx->server.empty()) {
    return Error(kUsage, "set-context: --server: required for a new context (" + name + ")");
  }
  if (!ctx->cert.empty() && ctx->key.empty()) {
    return Error(kUsage, "set-context: --key: required with --cert (" + name + ")");
  }
  if (config.current_context.empty()) config.current_context = name;
  if (auto st = SaveConfig(config); !st.ok()) return Error(kFailure, std::string(st.message()));
  std::cout << "context \"" << name << "\" " << (created ? "created" : "modified") << " in "
            << config.path << "\n";
  return kOk;
}

// `policy set`'s flags: the fields of the layer patch, as given.
struct PolicySetFlags {
  std::string layer;
  std::string format, scaling, rounding, geometry, ef;
  std::optional<uint32_t> block, hadamard_block;
  std::optional<int> rank, refresh;
  std::optional<float> alpha;
};

// What the command line sets. The subcommands share `job`, -f, --reason (only one runs).
struct Flags {
  std::string server, output = "table", config, context;
  std::string token, token_file;
  std::string tls_ca, tls_cert, tls_key;
  std::string file, key, id, reason, shell, ctx_name;
  std::vector<std::string> states;
  int limit = 0;
  int64_t version = 0;  // signed: CLI11 would wrap -1 into 2^64-1
  PolicySetFlags policy_set;
  Context given;  // config set-context's
  LogsFlags logs;
};

// The subcommands (set by AddCommands), to tell which one the command line names.
struct Commands {
  CLI::App *submit, *get_jobs, *get_job, *get_workers, *describe, *describe_job, *watch, *cancel,
      *delete_job, *policy, *policy_get, *policy_history, *policy_set, *policy_apply, *config_get,
      *config_current, *config_use, *config_set, *logs, *version, *completion;
};

// The global flags (--timeout sets g; the others are resolved with the config file, in Settings)
// and the help's footer.
void AddGlobalFlags(CLI::App& app, Flags* f, Globals* g) {
  app.require_subcommand(0, 1);
  app.footer(
      "Jobs are named by id or by the spec's name (an id wins; a name means the newest job of\n"
      "that name). Settings: flags, then env (GEOFP8_SERVER, GEOFP8_TOKEN), then\n"
      "the context of the config file (--config, env GEOFP8_CONFIG, default\n"
      "~/.config/geofp8/config.yaml).\n"
      "Exit codes: 0 ok, 1 failure (or watched job failed/cancelled), 2 usage error, 3 not found,\n"
      "4 server unreachable or deadline exceeded, 5 rejected by the server (a live job has the\n"
      "name, or a delete of an unfinished job), 6 unauthenticated, 7 the server cannot write its\n"
      "store.");
  app.add_option("-s,--server", f->server,
                 "Coordinator address (env GEOFP8_SERVER, else the context's, else "
                 "127.0.0.1:7070)");
  app.add_option("--token", f->token,
                 "Bearer token for every call to a coordinator that requires one, reads "
                 "included (visible in ps: prefer --token-file, env GEOFP8_TOKEN or a "
                 "context's token-file)");
  app.add_option("--token-file", f->token_file, "File whose first line is the bearer token");
  app.add_option("--tls-ca", f->tls_ca, "PEM CA that signed the server certificate (enables TLS)");
  app.add_option("--tls-cert", f->tls_cert, "PEM client certificate for mutual TLS");
  app.add_option("--tls-key", f->tls_key, "PEM key of --tls-cert");
  app.add_option("--timeout", g->timeout_s, "Deadline of each call, seconds")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 86400.0));
  app.add_option("-o,--output", f->output,
                 "Output format: table, wide, name, json, yaml, jsonpath=TEMPLATE (e.g. "
                 "jsonpath='{.progress.step}'; supported: .field, [N], [*], .*)")
      ->capture_default_str();
  app.add_option("--config", f->config,
                 "Config file with contexts (env GEOFP8_CONFIG; default "
                 "~/.config/geofp8/config.yaml)");
  app.add_option("--context", f->context, "Context of the config file to use for this command");
  app.fallthrough();
}

// submit, get, describe, watch, cancel, delete.
void AddJobCommands(CLI::App& app, Flags* f, Globals* g, Commands* c) {
  c->submit = app.add_subcommand("submit", "Submit a job spec (YAML)");
  c->submit->add_option("-f,--file", f->file, "Job spec file")->required();
  c->submit->add_option("--idempotency-key", f->key,
                        "Retries with the same key return the first job instead of a new one");

  auto* get = app.add_subcommand("get", "List or show resources");
  get->require_subcommand(1);
  c->get_jobs = get->add_subcommand("jobs", "List jobs, newest first");
  c->get_jobs->add_option("--state", f->states, "Only these states (repeatable)");
  c->get_jobs->add_option("--limit", f->limit, "At most this many")->check(kNonNegative);
  c->get_job = get->add_subcommand("job", "Show one job");
  c->get_job->add_option("job", f->id, "Job id or name")->required();
  c->get_workers = get->add_subcommand("workers", "List workers");

  c->describe = app.add_subcommand("describe", "Show a job in detail: ranks, policy, events");
  c->describe->require_subcommand(1);
  c->describe_job = c->describe->add_subcommand("job", "Describe one job");
  c->describe_job->add_option("job", f->id, "Job id or name")->required();

  c->watch = app.add_subcommand(
      "watch",
      "Follow a job until it ends: a status line redrawn in place on a terminal; otherwise a "
      "line per state change and per --every % of the steps");
  c->watch->add_option("job", f->id, "Job id or name")->required();
  c->watch
      ->add_option("--every", g->watch_every,
                   "Not a terminal: print progress every this many % of the steps (0: every "
                   "update)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 100.0));

  c->cancel = app.add_subcommand("cancel", "Cancel a job");
  c->cancel->add_option("job", f->id, "Job id or name")->required();
  c->cancel->add_option("--reason", f->reason, "Why (recorded in the job's events)");

  auto* del = app.add_subcommand("delete", "Delete a finished job and its records");
  del->require_subcommand(1);
  c->delete_job = del->add_subcommand(
      "job", "Delete a SUCCEEDED, FAILED or CANCELLED job: its events and policy versions go too");
  c->delete_job->add_option("job", f->id, "Job id or name")->required();
}

// policy get, history, set, apply.
void AddPolicyCommands(CLI::App& app, Flags* f, Commands* c) {
  c->policy = app.add_subcommand("policy", "Show or change a job's compression policy");
  c->policy->require_subcommand(1);
  c->policy_get = c->policy->add_subcommand("get", "Show a policy version (default: latest)");
  c->policy_get->add_option("job", f->id, "Job id or name")->required();
  c->policy_get->add_option("--version", f->version, "Version (0 = latest)");
  c->policy_history = c->policy->add_subcommand("history", "List the policy versions");
  c->policy_history->add_option("job", f->id, "Job id or name")->required();
  c->policy_set =
      c->policy->add_subcommand("set", "Patch the policy of the layers matching a glob");
  CLI::App* set = c->policy_set;
  PolicySetFlags* p = &f->policy_set;
  set->add_option("job", f->id, "Job id or name")->required();
  set->add_option("--layer", p->layer, "Layer name or glob, e.g. 'layers.*.attn.*'")->required();
  set->add_option("--format", p->format,
                  std::string("One of: ") + std::string(AcceptedFormatNames()));
  set->add_option("--scaling", p->scaling,
                  std::string("One of: ") + std::string(AcceptedScalingNames()));
  set->add_option("--block", p->block, "Elements per scale block");
  set->add_option("--rounding", p->rounding,
                  std::string("One of: ") + std::string(AcceptedRoundingNames()));
  set->add_option("--geometry", p->geometry,
                  std::string("One of: ") + std::string(AcceptedTransformNames()));
  set->add_option("--hadamard-block", p->hadamard_block,
                  "Hadamard rotation block (a power of two dividing the codec's scale "
                  "block; default: the scale block)");
  set->add_option("--rank", p->rank, "Low-rank k");
  set->add_option("--alpha", p->alpha, "Whitening exponent");
  set->add_option("--error-feedback", p->ef, "on or off")->check(CLI::IsMember({"on", "off"}));
  set->add_option("--refresh-interval", p->refresh, "Geometry refresh interval, steps");
  set->add_option("--reason", f->reason, "Why (recorded with the version)");
  c->policy_apply = c->policy->add_subcommand(
      "apply", "Apply a policy patch file (YAML; what `policy get -o yaml` prints)");
  c->policy_apply->add_option("job", f->id, "Job id or name")->required();
  c->policy_apply->add_option("-f,--file", f->file, "Patch file, or - for standard input")
      ->required();
}

// config get-contexts, current-context, use-context, set-context.
void AddConfigCommands(CLI::App& app, Flags* f, Commands* c) {
  auto* config = app.add_subcommand("config", "Show or change the config file's contexts");
  config->require_subcommand(1);
  c->config_get = config->add_subcommand("get-contexts", "List the contexts (* = current)");
  c->config_current = config->add_subcommand("current-context", "Print the current context");
  c->config_use = config->add_subcommand("use-context", "Make a context the current one");
  c->config_use->add_option("name", f->ctx_name, "Context name")->required();
  c->config_set = config->add_subcommand(
      "set-context", "Create or update a context (the first one becomes current)");
  CLI::App* set = c->config_set;
  set->add_option("name", f->ctx_name, "Context name")->required();
  set->add_option("--server", f->given.server, "Coordinator address host:port");
  set->add_option("--token-file", f->given.token_file, "Bearer token file");
  set->add_option("--ca", f->given.ca, "PEM CA of the server certificate");
  set->add_option("--cert", f->given.cert, "PEM client certificate (mutual TLS)");
  set->add_option("--key", f->given.key, "PEM key of --cert");
}

// Every subcommand, in the order the help lists them.
void AddCommands(CLI::App& app, Flags* f, Globals* g, Commands* c) {
  AddJobCommands(app, f, g, c);
  AddPolicyCommands(app, f, c);
  AddConfigCommands(app, f, c);
  c->logs = AddLogsCommand(app, &f->id, &f->logs);
  c->version = app.add_subcommand("version", "Print the client version");
  c->completion = app.add_subcommand(
      "completion", "Print a shell completion script: source <(geofp8ctl completion bash)");
  c->completion->add_option("shell", f->shell, "bash or zsh")
      ->required()
      ->check(CLI::IsMember({"bash", "zsh"}));
}

// Parses the command line. Returns -1 to go on, else the exit code: the help was printed (no
// command given, or --help) or the command line is wrong.
int Parse(CLI::App& app, int argc, char** argv) {
  if (argc <= 1) {  // bare invocation: the help, as kubectl does
    std::cout << app.help();
    return kOk;
  }
  if (int rc = CheckCommands(app, argc, argv); rc >= 0) return rc;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "geofp8ctl: error: %s\n", e.what());
    std::fprintf(stderr, "run 'geofp8ctl --help' for usage\n");
    return kUsage;
  }
  if (app.get_subcommands().empty()) {  // only global flags
    std::cout << app.help();
    return kOk;
  }
  return -1;
}

// -o (into g) and the values CLI11 cannot check by itself.
int CheckFlags(const Flags& f, const Commands& c, Globals* g) {
  if (std::string e = ParseOutput(f.output, g); !e.empty()) return Error(kUsage, e);
  if (f.version < 0) {
    return Error(kUsage, "--version: must be >= 0, 0 = latest (" + std::to_string(f.version) + ")");
  }
  if (g->output == "name" && (*c.describe || *c.watch || *c.policy || *c.version)) {
    return Error(kUsage, "-o name: only for get, submit, cancel, delete and config get-contexts");
  }
  return kOk;
}

int PrintVersion(const Globals& g) {
  // The coordinator's API has no version call, so only the client's is known.
  Doc v = Doc::Object();
  v.Add("clientVersion", Doc::String(std::string(kVersion)));
  v.Add("gitDescribe", Doc::String(std::string(kGitDescribe)));
  if (g.output == "json") {
    std::cout << DocToJson(v);
  } else if (g.output == "yaml") {
    std::cout << DocToYaml(v);
  } else if (g.output == "jsonpath") {
    auto text = JsonPath(v, g.jsonpath);
    if (!text.ok()) return Error(kUsage, "-o " + std::string(text.status().message()));
    std::cout << *text;
  } else {
    std::cout << "Client Version: " << kVersion << " (git " << kGitDescribe << ")\n";
  }
  return kOk;
}

// The bearer token: the first line of `path`; `flag` names the file in the errors.
int ReadToken(const std::string& flag, const std::string& path, std::string* token) {
  std::string text;
  if (std::string e = ReadFile(flag, path, &text); !e.empty()) return Error(kUsage, e);
  *token = text.substr(0, text.find_first_of("\r\n"));
  if (token->empty()) return Error(kUsage, flag + ": first line is empty (" + path + ")");
  return kOk;
}

// The server, TLS files and token of g. Precedence: flag, then environment, then the context
// (--context, else the config's current one), then the default.
int Settings(const Flags& f, const Config& config, const std::string& config_path, Globals* g) {
  const Context* ctx = nullptr;
  if (!f.context.empty()) {
    ctx = config.Find(f.context);
    if (!ctx) {
      return Error(kUsage, "--context: no context named " + f.context + " in " + config_path);
    }
  } else if (!config.current_context.empty()) {
    ctx = config.Find(config.current_context);
  }
  const char* env_server = std::getenv("GEOFP8_SERVER");
  const char* env_token = std::getenv("GEOFP8_TOKEN");
  if (!f.server.empty()) {
    g->server = f.server;
  } else if (env_server && *env_server) {
    g->server = env_server;
  } else if (ctx && !ctx->server.empty()) {
    g->server = ctx->server;
  }
  g->tls_ca = !f.tls_ca.empty() ? f.tls_ca : ctx ? ResolvePath(config_path, ctx->ca) : "";
  g->tls_cert = !f.tls_cert.empty() ? f.tls_cert : ctx ? ResolvePath(config_path, ctx->cert) : "";
  g->tls_key = !f.tls_key.empty() ? f.tls_key : ctx ? ResolvePath(config_path, ctx->key) : "";
  if (!f.token.empty()) {
    std::fprintf(stderr,
                 "geofp8ctl: warning: --token: other users can read it in the process list; use "
                 "--token-file or GEOFP8_TOKEN\n");
    g->token = f.token;
    g->token_source = "--token";
  } else if (!f.token_file.empty()) {
    g->token_source = "--token-file " + f.token_file;
    return ReadToken("--token-file", f.token_file, &g->token);
  } else if (env_token && *env_token) {
    g->token = env_token;
    g->token_source = "env GEOFP8_TOKEN";
  } else if (ctx && !ctx->token_file.empty()) {
    const std::string path = ResolvePath(config_path, ctx->token_file);
    g->token_source = "context " + ctx->name + "'s token-file " + path;
    return ReadToken(config_path + ": context " + ctx->name + ": token-file", path, &g->token);
  }
  return kOk;
}

// `policy set`'s flags as a layer patch, checked here: a usage error never needs the server.
int PolicySetPatch(const PolicySetFlags& f, LayerPatchSpec* out) {
  LayerPatchSpec p;
  p.match = f.layer;
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
  if (!named(f.format, "--format", ParseFormatName, AcceptedFormatNames(), &p.format) ||
      !named(f.scaling, "--scaling", ParseScalingName, AcceptedScalingNames(), &p.scaling) ||
      !named(f.rounding, "--rounding", ParseRoundingName, AcceptedRoundingNames(), &p.rounding)) {
    return kUsage;
  }
  if (!f.geometry.empty()) {
    // A transform name sets the geometry and the rotation together, as the job spec's does.
    const std::optional<GeometryTransform> t = ParseTransformName(f.geometry);
    if (!t) {
      return Error(kUsage, "--geometry: unknown value (" + f.geometry +
                               "); accepted: " + std::string(AcceptedTransformNames()));
    }
    p.geometry = t->geometry;
    p.hadamard = t->hadamard;
  }
  p.hadamard_block = f.hadamard_block;
  p.block = f.block;
  p.rank = f.rank;
  p.alpha = f.alpha;
  p.refresh_interval = f.refresh;
  if (!f.ef.empty()) p.error_feedback = f.ef == "on";
  if (!p.format && !p.scaling && !p.block && !p.rounding && !p.geometry && !p.rank && !p.alpha &&
      !p.error_feedback && !p.refresh_interval && !p.hadamard_block) {
    return Error(kUsage,
                 "policy set: give at least one of --format --scaling --block "
                 "--rounding --geometry --hadamard-block --rank --alpha --error-feedback "
                 "--refresh-interval");
  }
  if (std::string e = ValidateLayerPatch(p, "--layer " + f.layer); !e.empty()) {
    return Error(kUsage, e);
  }
  *out = p;
  return kOk;
}

// The update `policy set` or `policy apply` sends: the patches, the new defaults, the reason.
struct PolicyChange {
  std::vector<LayerPatchSpec> patches;
  std::optional<LayerPolicy> defaults;
  std::string reason;
};

// `policy apply`'s file, read and checked here: a usage error never needs the server.
int ReadPolicyPatchFile(const std::string& file, PolicyChange* change) {
  std::string text;
  if (std::string e = ReadFile("-f", file, &text); !e.empty()) return Error(kUsage, e);
  auto parsed = ParsePolicyPatch(text);
  if (!parsed.ok()) return Error(kUsage, file + ": " + std::string(parsed.status().message()));
  change->patches = parsed->layers;
  change->defaults = parsed->defaults;
  change->reason = parsed->reason.empty() ? "applied " + file : parsed->reason;
  return kOk;
}

// Runs the command that needs the server.
int Dispatch(Client& client, const Flags& f, const Commands& c, const PolicyChange& change) {
  if (*c.submit) return client.Submit(f.file, f.key);
  if (*c.get_jobs) return client.GetJobs(f.states, f.limit);
  if (*c.get_job) return client.GetJob(f.id, false);
  if (*c.get_workers) return client.GetWorkers();
  if (*c.describe_job) return client.GetJob(f.id, true);
  if (*c.watch) return client.Watch(f.id);
  if (*c.logs) return client.Logs(f.id, f.logs);
  if (*c.cancel) return client.Cancel(f.id, f.reason);
  if (*c.delete_job) return client.Delete(f.id);
  if (*c.policy_get) return client.PolicyGet(f.id, f.version);
  if (*c.policy_history) return client.PolicyHistory(f.id);
  if (*c.policy_set || *c.policy_apply) {
    return client.PolicyUpdate(f.id, change.patches, change.defaults, change.reason);
  }
  return Error(kUsage, "no command given; run 'geofp8ctl --help'");
}

int Run(int argc, char** argv) {
  Globals g;
  Flags f;
  Commands c{};
  CLI::App app{"geofp8ctl: control GeoFP8 training jobs through the coordinator", "geofp8ctl"};
  AddGlobalFlags(app, &f, &g);
  AddCommands(app, &f, &g, &c);
  if (int rc = Parse(app, argc, argv); rc >= 0) return rc;
  if (int rc = CheckFlags(f, c, &g); rc != kOk) return rc;

  // The commands that need neither the config file nor the server.
  if (*c.completion) {
    std::cout << CompletionScript(Tree(app), f.shell);
    return kOk;
  }
  if (*c.version) return PrintVersion(g);

  const std::string config_path = ConfigPath(f.config);
  // As kubectl's --kubeconfig and KUBECONFIG: a missing --config file is an error, a missing
  // GEOFP8_CONFIG or default file an empty config (set-context creates it).
  auto loaded = LoadConfig(config_path, !f.config.empty() && !*c.config_set);
  if (!loaded.ok()) return Error(kUsage, std::string(loaded.status().message()));
  if (*c.config_get || *c.config_current || *c.config_use || *c.config_set) {
    const std::string what = *c.config_get       ? "get-contexts"
                             : *c.config_current ? "current-context"
                             : *c.config_use     ? "use-context"
                                                 : "set-context";
    return ConfigCommand(what, *loaded, f.ctx_name, f.given, g);
  }
  if (int rc = Settings(f, *loaded, config_path, &g); rc != kOk) return rc;

  // Local validation before any network call: a usage error never needs the server.
  PolicyChange change;
  change.reason = f.reason;
  if (*c.policy_set) {
    LayerPatchSpec p;
    if (int rc = PolicySetPatch(f.policy_set, &p); rc != kOk) return rc;
    change.patches.push_back(p);
  }
  if (*c.policy_apply) {
    if (int rc = ReadPolicyPatchFile(f.file, &change); rc != kOk) return rc;
  }

  Client client(g);
  if (int rc = client.Connect(); rc != kOk) return rc;
  return Dispatch(client, f, c, change);
}

}  // namespace
}  // namespace geofp8::ctl

int main(int argc, char** argv) { return geofp8::ctl::Run(argc, argv); }
