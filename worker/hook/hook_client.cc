// HookClient (see hook_client.h): one reader thread owns the Attach stream (open, read, reopen
// with backoff); reports write to the open stream under a write mutex.
#include "worker/hook/hook_client.h"

#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>

#include "geofp8/v1/geofp8.grpc.pb.h"
#include "kernels/common/check.h"
#include "platform/policy/policy.h"

namespace geofp8::hook {

namespace {

using std::chrono::milliseconds;

constexpr milliseconds kBackoffInitial{50};
constexpr milliseconds kBackoffMax{1000};
// On destruction, how long the worker may take to confirm it has read everything written.
constexpr milliseconds kCloseWait{2000};
constexpr int kExitAttemptEnded = 75;  // worker/daemon/command_runner.h

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

int64_t EnvInt(const char* name, int64_t fallback) {
  const std::string v = Env(name);
  if (v.empty()) return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  return end && *end == '\0' ? x : fallback;
}

}  // namespace

struct HookClient::Impl {
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::HookService::Stub> stub;

  mutable std::mutex mu_;  // everything below but the stream
  std::condition_variable cv_;
  bool closing = false;
  bool connected = false;
  std::map<uint64_t, v1::Policy> policies;  // every version received
  std::optional<v1::RefreshSchedules> refresh;
  std::optional<v1::HookWelcome> welcome;
  uint64_t in_force = 0;
  std::vector<LayerInfo> catalog;
  std::string model_name;
  bool catalog_set = false;
  std::deque<v1::HookMessage> pending;  // reliable reports waiting for a stream
  // Attach mode (GEOFP8_JOB set): the first message of every channel, the worker's refusal,
  // and whether a welcome came (after which a lost channel ends the program: its rank is gone).
  std::optional<v1::HookAttach> attach;
  std::string refused;
  bool welcomed = false;

  std::mutex write_mu_;  // one writer at a time; guards stream and context
  std::unique_ptr<grpc::ClientContext> context;
  std::unique_ptr<grpc::ClientReaderWriter<v1::HookMessage, v1::HookCommand>> stream;

  std::thread reader;

  // Writes on the open stream; false (message not written) when there is none or it broke.
  bool Write(const v1::HookMessage& m) {
    std::lock_guard<std::mutex> lock(write_mu_);
    return stream && stream->Write(m);
  }

  // A report that must get through: written now, or kept for the next stream.
  void WriteReliable(const v1::HookMessage& m) {
    std::lock_guard<std::mutex> wl(write_mu_);
    if (stream && stream->Write(m)) return;
    std::lock_guard<std::mutex> lock(mu_);
    pending.push_back(m);
  }

  static v1::HookMessage CatalogMessage(const std::vector<LayerInfo>& layers,
                                        const std::string& model_name) {
    v1::HookMessage m;
    m.mutable_catalog()->set_model_name(model_name);
    for (const LayerInfo& l : layers) {
      auto* li = m.mutable_catalog()->add_layers();
      li->set_name(l.name);
      li->set_rows(l.rows);
      li->set_cols(l.cols);
    }
    return m;
  }

  // An attached rank that is to stop: says why on stderr and ends the process with `code`, as
  // docs/launchers.md ("Exit codes") documents, so its launcher sees a failure, never a hang in a
  // collective whose peers are gone.
  [[noreturn]] void Exit(const std::string& reason, int code) {
    std::fprintf(stderr, "geofp8: rank %d of job %s: %s; exiting with code %d\n",
                 attach ? attach->rank() : 0, attach ? attach->job().c_str() : "?", reason.c_str(),
                 code);
    std::fflush(stderr);
    std::fflush(stdout);
    std::_Exit(code);
  }

  void Loop() {
    milliseconds backoff = kBackoffInitial;
    for (;;) {
      {
        std::lock_guard<std::mutex> wl(write_mu_);
        std::lock_guard<std::mutex> lock(mu_);
        if (closing) return;
        context = std::make_unique<grpc::ClientContext>();
        stream = stub->Attach(context.get());
        if (attach) {
          v1::HookMessage first;
          *first.mutable_attach() = *attach;
          stream->Write(first);  // a broken stream fails its Read below
        }
      }
      v1::HookCommand c;
      bool attached = false;
      while (stream->Read(&c)) {
        if (!attached) {
          attached = true;
          backoff = kBackoffInitial;
          // A new channel: the catalog again, then what could not be written before.
          std::lock_guard<std::mutex> wl(write_mu_);
          std::unique_lock<std::mutex> lock(mu_);
          connected = true;
          std::vector<v1::HookMessage> out;
          if (catalog_set) out.push_back(CatalogMessage(catalog, model_name));
          out.insert(out.end(), pending.begin(), pending.end());
          pending.clear();
          lock.unlock();
          for (size_t i = 0; i < out.size(); ++i) {
            if (!stream->Write(out[i])) {
              lock.lock();
              // Not written: keep the reliable ones (the catalog is re-sent anyway).
              for (size_t j = catalog_set ? std::max<size_t>(i, 1) : i; j < out.size(); ++j) {
                pending.push_back(out[j]);
              }
              lock.unlock();
              break;
            }
          }
        }
        if (c.has_stop()) Exit(c.stop().reason(), c.stop().exit_code());
        std::lock_guard<std::mutex> lock(mu_);
        if (c.has_refused()) {
          refused = c.refused();
          cv_.notify_all();
          break;
        }
        if (c.has_welcome()) {
          welcome = c.welcome();
          welcomed = true;
        }
        // A version resent on a new channel may now carry its taken_step: keep the newest copy.
        if (c.has_policy()) policies[c.policy().version()] = c.policy();
        if (c.has_refresh()) refresh = c.refresh();
        cv_.notify_all();
      }
      {
        std::lock_guard<std::mutex> wl(write_mu_);
        stream->Finish();
        stream.reset();
        context.reset();
        std::lock_guard<std::mutex> lock(mu_);
        connected = false;
      }
      cv_.notify_all();
      std::unique_lock<std::mutex> lock(mu_);
      if (!refused.empty()) return;  // the worker said why; no point trying again
      if (attach && welcomed && !closing) {
        lock.unlock();
        Exit(
            "the hook channel to its attach-only worker closed (the worker left or its attempt "
            "ended)",
            kExitAttemptEnded);
      }
      if (cv_.wait_for(lock, backoff, [&] { return closing; })) return;
      backoff = std::min(backoff * 2, kBackoffMax);
    }
  }
};

std::unique_ptr<HookClient> HookClient::FromEnvironment() {
  std::string address = Env("GEOFP8_HOOK_ADDRESS");
  if (address.empty()) return nullptr;
  // One attach-only worker per local rank: torchrun gives every rank the same environment.
  static constexpr std::string_view kLocalRank = "{local_rank}";
  if (const size_t at = address.find(kLocalRank); at != std::string::npos) {
    const std::string local = Env("LOCAL_RANK");
    address.replace(at, kLocalRank.size(), local.empty() ? "0" : local);
  }
  return Connect(address);
}

std::unique_ptr<HookClient> HookClient::Connect(const std::string& address) {
  std::unique_ptr<HookClient> c(new HookClient());
  c->job_id_ = Env("GEOFP8_JOB_ID");
  c->attempt_ = int(EnvInt("GEOFP8_ATTEMPT", 0));
  c->rank_ = int(EnvInt("RANK", 0));
  c->world_size_ = int(EnvInt("WORLD_SIZE", 1));
  c->resume_step_ = EnvInt("GEOFP8_RESUME_STEP", 0);
  c->checkpoint_dir_ = Env("GEOFP8_CHECKPOINT_DIR");
  c->impl_ = std::make_unique<Impl>();
  // Attach mode: the launcher started this process; it names its external job (GEOFP8_JOB),
  // and RANK/WORLD_SIZE are the launcher's.
  if (const std::string job = Env("GEOFP8_JOB"); !job.empty()) {
    v1::HookAttach a;
    a.set_job(job);
    a.set_rank(c->rank_);
    a.set_world_size(c->world_size_);
    std::string token = Env("GEOFP8_TOKEN");
    if (const std::string file = Env("GEOFP8_TOKEN_FILE"); !file.empty()) {
      std::ifstream in(file);
      std::getline(in, token);
      while (!token.empty() && (token.back() == '\r' || token.back() == ' ')) token.pop_back();
    }
    a.set_token(token);
    c->impl_->attach = a;
  }
  // A local socket: when the worker restarts its server, reconnect within about a second rather
  // than after gRPC's default backoff (up to two minutes).
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, int(kBackoffInitial.count()));
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, int(kBackoffInitial.count()));
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, int(kBackoffMax.count()));
  c->impl_->channel = grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  c->impl_->stub = v1::HookService::NewStub(c->impl_->channel);
  Impl* impl = c->impl_.get();
  impl->reader = std::thread([impl] { impl->Loop(); });
  return c;
}

HookClient::~HookClient() {
  Impl& i = *impl_;
  {
    // Half-close: the worker reads what was written, then ends the stream.
    std::lock_guard<std::mutex> wl(i.write_mu_);
    std::lock_guard<std::mutex> lock(i.mu_);
    i.closing = true;
    if (i.stream) i.stream->WritesDone();
  }
  i.cv_.notify_all();
  {
    std::unique_lock<std::mutex> lock(i.mu_);
    if (!i.cv_.wait_for(lock, kCloseWait, [&] { return !i.connected; })) {
      lock.unlock();
      std::lock_guard<std::mutex> wl(i.write_mu_);
      if (i.context) i.context->TryCancel();
    }
  }
  // A stream that never attached (no worker) ends on its own: Read fails, then closing.
  {
    std::lock_guard<std::mutex> wl(i.write_mu_);
    if (i.context) i.context->TryCancel();
  }
  if (i.reader.joinable()) i.reader.join();
}

void HookClient::SendCatalog(const std::vector<LayerInfo>& layers, const std::string& model_name) {
  {
    std::lock_guard<std::mutex> lock(impl_->mu_);
    impl_->catalog = layers;
    impl_->model_name = model_name;
    impl_->catalog_set = true;
  }
  impl_->Write(Impl::CatalogMessage(layers, model_name));  // else sent when the channel (re)opens
}

void HookClient::ReportStep(int64_t step, double loss, double tokens_per_second,
                            uint64_t bytes_sent, uint64_t bytes_baseline) {
  ReportStep(step, loss, tokens_per_second, bytes_sent, bytes_baseline, 0.0, 0.0);
}

void HookClient::ReportStep(int64_t step, double loss, double tokens_per_second,
                            uint64_t bytes_sent, uint64_t bytes_baseline, double step_seconds,
                            double exchange_seconds, std::optional<double> val_loss) {
  GEOFP8_CHECK(!val_loss || std::isfinite(*val_loss), "report: val_loss must be finite (",
               val_loss.value_or(0.0), ")");
  v1::HookMessage m;
  auto* p = m.mutable_progress();
  p->set_step(step);
  p->set_loss(loss);
  p->set_tokens_per_second(tokens_per_second);
  p->set_bytes_sent(bytes_sent);
  p->set_bytes_baseline(bytes_baseline);
  p->set_policy_version(version_in_force());
  p->set_step_seconds(step_seconds);
  p->set_exchange_seconds(exchange_seconds);
  if (val_loss) p->set_val_loss(*val_loss);
  impl_->Write(m);
}

void HookClient::ReportLayers(const std::vector<LayerReport>& layers) {
  v1::HookMessage m;
  for (const LayerReport& l : layers) {
    auto* s = m.mutable_summaries()->add_layers();
    s->set_layer(l.layer);
    s->set_step(l.step);
    s->set_rel_fro_error(l.rel_fro_error);
    s->set_residual_error(l.residual_error);
    s->set_geometry_version(l.geometry_version);
    s->set_drift(l.drift);
  }
  impl_->Write(m);
}

void HookClient::ReportProbes(const std::vector<v1::ProbeResult>& probes) {
  v1::HookMessage m;
  for (const v1::ProbeResult& p : probes) *m.mutable_probes()->add_probes() = p;
  impl_->Write(m);
}

void HookClient::ReportCheckpoint(int64_t step, const std::string& path) {
  v1::HookMessage m;
  m.mutable_checkpoint()->set_step(step);
  m.mutable_checkpoint()->set_path(path);
  impl_->WriteReliable(m);
}

namespace {

// `due` as a PolicyChange resolved against `catalog`, with the refresh schedules in force.
PolicyChange MakeChange(const v1::Policy& due, const std::vector<LayerInfo>& catalog,
                        const std::optional<v1::RefreshSchedules>& refresh) {
  PolicyChange change;
  change.version = due.version();
  change.effective_step = due.effective_step();
  change.reason = due.reason();
  change.policy = due;
  for (const LayerInfo& l : catalog) {
    ResolvedLayer r = ResolveLayer(due, l.name);
    // 1-D tensors never use geometry (as the trainer's ResolveLayers).
    if (l.cols <= 1) r.policy.set_geometry(v1::GEOMETRY_NONE);
    change.layers.push_back({l.name, r.policy, r.refresh_interval});
  }
  if (due.refresh_size() > 0) {
    change.refresh.assign(due.refresh().begin(), due.refresh().end());
  } else if (refresh) {
    change.refresh.assign(refresh->schedules().begin(), refresh->schedules().end());
  }
  return change;
}

}  // namespace

std::optional<PolicyChange> HookClient::PolicyDueAt(int64_t step) {
  PolicyChange change;
  {
    std::lock_guard<std::mutex> lock(impl_->mu_);
    const v1::Policy* due = nullptr;
    for (const auto& [version, p] : impl_->policies) {
      if (version > impl_->in_force && p.effective_step() <= step) due = &p;
    }
    if (!due) return std::nullopt;
    impl_->in_force = due->version();
    change = MakeChange(*due, impl_->catalog, impl_->refresh);
  }
  v1::HookMessage ack;
  ack.mutable_policy_ack()->set_version(change.version);
  ack.mutable_policy_ack()->set_step(step);
  impl_->Write(ack);
  return change;
}

uint64_t HookClient::NewestHeld() const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return std::max(impl_->in_force,
                  impl_->policies.empty() ? uint64_t{0} : impl_->policies.rbegin()->first);
}

std::optional<PolicyChange> HookClient::PolicyAgreedAt(int64_t step, uint64_t agreed) {
  PolicyChange change;
  int64_t taken = step;
  {
    std::lock_guard<std::mutex> lock(impl_->mu_);
    const uint64_t in_force = impl_->in_force;
    std::optional<v1::Policy> due;
    if (in_force == 0) {
      // The attempt's start step: the version in force there (the worker's TakeStart).
      due = StartVersion(impl_->policies, step);
      if (due && due->has_taken_step()) taken = due->taken_step();
    } else {
      due = DueVersion(impl_->policies, in_force, step, agreed);  // the worker's TakeDue
    }
    if (!due) return std::nullopt;
    impl_->in_force = due->version();
    change = MakeChange(*due, impl_->catalog, impl_->refresh);
  }
  v1::HookMessage ack;
  ack.mutable_policy_ack()->set_version(change.version);
  ack.mutable_policy_ack()->set_step(taken);
  // The worker relays rank 0's ack reliably: the coordinator records it as the taken_step.
  impl_->WriteReliable(ack);
  return change;
}

std::optional<v1::HookWelcome> HookClient::WaitForWelcome(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(impl_->mu_);
  if (!impl_->cv_.wait_for(lock, timeout,
                           [&] { return impl_->welcome.has_value() || !impl_->refused.empty(); })) {
    return std::nullopt;
  }
  return impl_->welcome;
}

int64_t HookClient::resume_step() const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return impl_->attach && impl_->welcome ? impl_->welcome->resume_step() : resume_step_;
}

std::string HookClient::refused() const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return impl_->refused;
}

bool HookClient::attach_mode() const { return impl_->attach.has_value(); }

void HookClient::Finish(bool success, const std::string& reason) {
  v1::HookMessage m;
  m.mutable_finished()->set_success(success);
  m.mutable_finished()->set_reason(reason.substr(0, 4096));
  impl_->Write(m);
}

std::optional<std::vector<v1::RefreshSchedule>> HookClient::WaitForRefresh(
    std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(impl_->mu_);
  if (!impl_->cv_.wait_for(lock, timeout, [&] { return impl_->refresh.has_value(); })) {
    return std::nullopt;
  }
  return std::vector<v1::RefreshSchedule>(impl_->refresh->schedules().begin(),
                                          impl_->refresh->schedules().end());
}

bool HookClient::WaitForPolicy(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(impl_->mu_);
  return impl_->cv_.wait_for(lock, timeout, [&] { return !impl_->policies.empty(); });
}

uint64_t HookClient::version_in_force() const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return impl_->in_force;
}

bool HookClient::connected() const {
  std::lock_guard<std::mutex> lock(impl_->mu_);
  return impl_->connected;
}

}  // namespace geofp8::hook
