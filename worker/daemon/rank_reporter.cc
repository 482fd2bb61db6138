#include "worker/daemon/rank_reporter.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "kernels/codec/codec.h"
#include "platform/policy/policy.h"
#include "worker/daemon/log.h"

namespace geofp8::worker {

namespace {

int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

std::string HexChecksum(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

RankReporter::RankReporter(const v1::Assignment& assignment, const JobRunner::SendFn& send,
                           WorkerMetrics* metrics, std::string data_dir, int log_progress_every)
    : a_(assignment),
      send_(send),
      metrics_(metrics),
      data_dir_(std::move(data_dir)),
      log_progress_every_(log_progress_every),
      steps_done_(assignment.resume_step()) {}

void RankReporter::Catalog(const std::vector<model::ParamInfo>& params) {
  v1::WorkerMessage m;
  for (const auto& p : params) {
    auto* li = m.mutable_catalog()->add_layers();
    li->set_name(p.name);
    li->set_rows(p.exchange_rows());
    li->set_cols(p.exchange_cols());
  }
  Send(std::move(m), true);
}

void RankReporter::PolicyInForce(const v1::Policy& p, int64_t step, int64_t taken) {
  if (metrics_) metrics_->PolicyVersion(p.version());
  log::Info("policy.taken")
      .F("job", a_.job_id())
      .F("attempt", a_.attempt())
      .F("rank", a_.rank())
      .F("version", p.version())
      .F("step", step)
      .F("effective_step", p.effective_step())
      .Msg("policy v" + std::to_string(p.version()) + " in force from step " +
           std::to_string(step) + " (" + p.reason() + ")");
  v1::WorkerMessage ack;
  ack.mutable_policy_ack()->set_version(p.version());
  ack.mutable_policy_ack()->set_step(taken);
  ack.mutable_policy_ack()->set_job_id(a_.job_id());
  ack.mutable_policy_ack()->set_attempt(a_.attempt());
  Send(std::move(ack), a_.rank() == 0);
}

void RankReporter::CheckpointWritten(int64_t next_step, const std::string& path) {
  if (metrics_) metrics_->Checkpoint(next_step);
  log::Info("checkpoint.written")
      .F("job", a_.job_id())
      .F("attempt", a_.attempt())
      .F("rank", a_.rank())
      .F("step", next_step)
      .F("path", path)
      .Msg("checkpoint after " + std::to_string(next_step) + " steps");
  v1::WorkerMessage m;
  m.mutable_checkpoint()->set_step(next_step);
  m.mutable_checkpoint()->set_path(path);
  m.mutable_checkpoint()->set_job_id(a_.job_id());
  m.mutable_checkpoint()->set_attempt(a_.attempt());
  Send(std::move(m), true);
}

void RankReporter::CheckpointFailed(int64_t next_step, const std::string& why) {
  log::Event(log::Level::kError, "checkpoint.failed")
      .F("job", a_.job_id())
      .F("attempt", a_.attempt())
      .F("rank", a_.rank())
      .F("step", next_step)
      .F("error", why)
      .Msg("checkpoint at step " + std::to_string(next_step) + " not written (" + why +
           "); the recovery point stays where it was; retrying at the next interval");
  if (metrics_) metrics_->Error("checkpoint_write");
}

void RankReporter::StepMetrics(int64_t step, const train::StepRecord& rec, double tokens_per_second,
                               const std::vector<model::ParamInfo>& params,
                               const std::vector<LayerPolicy>& layer_policies,
                               const std::vector<RefreshSchedule>& schedule,
                               const train::Trainer& trainer) {
  if (!metrics_) return;
  metrics_->Step(step, rec.loss, tokens_per_second,
                 {rec.step_seconds, rec.exchange_seconds, rec.geometry_seconds}, rec.skipped);
  metrics_->GradientNoiseScale(rec.gradient_noise_scale);
  const std::vector<double> bytes = trainer.exchanger().LayerBytesSent(rec.exchange);
  for (size_t l = 0; l < bytes.size(); ++l) {
    metrics_->LayerBytes(params[l].name, std::string(FormatNameOf(layer_policies[l].format)),
                         bytes[l]);
  }
  for (const RefreshRecord& rr : rec.exchange.refreshes) {
    // Every rank learns each refresh; the metric counts the ones this rank estimated.
    if (schedule[rr.layer].owner == a_.rank()) metrics_->Refresh(params[rr.layer].name, rr.drift);
  }
}

void RankReporter::Progress(int64_t step, int64_t steps, double loss, double tokens_per_second,
                            uint64_t bytes_sent, uint64_t bytes_baseline, uint64_t policy_version,
                            double val_loss, double gradient_noise_scale) {
  steps_done_ = step + 1;
  if (!std::isnan(val_loss)) {
    if (metrics_) metrics_->ValidationLoss(step, val_loss);
    last_val_loss_ = val_loss;
    last_val_step_ = step;
  }
  if (a_.rank() == 0 && log_progress_every_ > 0 && (step + 1) % log_progress_every_ == 0) {
    log::Event e(log::Level::kInfo, "job.progress");
    e.F("job", a_.job_id())
        .F("attempt", a_.attempt())
        .F("rank", a_.rank())
        .F("step", step)
        .F("loss", loss)
        .F("tokens_per_second", tokens_per_second)
        .F("policy_version", policy_version);
    if (last_val_step_ >= 0) e.F("val_loss", last_val_loss_).F("val_step", last_val_step_);
    e.Msg("step " + std::to_string(step + 1) + "/" + std::to_string(steps));
  }
  v1::WorkerMessage pm;
  auto* p = pm.mutable_progress();
  p->set_step(step);
  p->set_loss(loss);
  p->set_tokens_per_second(tokens_per_second);
  p->set_bytes_sent(bytes_sent);
  p->set_bytes_baseline(bytes_baseline);
  p->set_policy_version(policy_version);
  if (!std::isnan(val_loss)) p->set_val_loss(val_loss);
  if (std::isfinite(gradient_noise_scale) && gradient_noise_scale > 0) {
    p->set_gradient_noise_scale(gradient_noise_scale);
  }
  Send(std::move(pm), false);
}

void RankReporter::Summaries(const train::StepRecord& rec,
                             const std::vector<model::ParamInfo>& params,
                             const train::Trainer& trainer) {
  if (a_.rank() != 0) return;
  v1::WorkerMessage m;
  auto* sums = m.mutable_summaries();
  for (size_t l = 0; l < params.size(); ++l) {
    auto* s = sums->add_layers();
    s->set_layer(params[l].name);
    s->set_step(rec.step);
    s->set_rel_fro_error(rec.layer_error[l]);
    s->set_residual_error(rec.residual_error[l]);
    s->set_geometry_version(trainer.exchanger().active_geometry(uint32_t(l)).version);
    s->set_drift(trainer.last_drift()[l]);
    if (metrics_) metrics_->LayerError(params[l].name, rec.layer_error[l]);
  }
  Send(std::move(m), false);
}

void RankReporter::Probes(int64_t step, const std::vector<LayerProbe>& probes_done,
                          const std::vector<model::ParamInfo>& params,
                          const train::Trainer& trainer, double last_step_seconds) {
  v1::WorkerMessage m;
  auto* probes = m.mutable_probes();
  for (const LayerProbe& lp : probes_done) {
    const std::string& name = params[lp.layer].name;
    auto* pr = probes->add_probes();
    pr->set_layer(name);
    pr->set_step(step);
    pr->set_error_without(lp.error_without);
    pr->set_error_with(lp.error_with);
    pr->set_transform_seconds(lp.transform_seconds);
    pr->set_step_seconds(last_step_seconds);
    pr->set_drift(trainer.last_drift()[lp.layer]);
    pr->set_basis(lp.basis == ProbeBasisKind::kDeployed ? v1::PROBE_BASIS_DEPLOYED
                                                        : v1::PROBE_BASIS_SHADOW);
    if (metrics_ && lp.error_with > 0) {
      metrics_->ProbeGain(name, ProbeBasisName(pr->basis()), lp.error_without / lp.error_with);
    }
  }
  if (probes->probes_size() > 0) Send(std::move(m), false);
}

void RankReporter::Started() {
  if (metrics_) metrics_->JobStarted(a_.job_id(), a_.rank(), a_.world_size());
  log::Info("rank.started")
      .F("job", a_.job_id())
      .F("attempt", a_.attempt())
      .F("rank", a_.rank())
      .F("world_size", a_.world_size())
      .F("step", a_.resume_step())
      .Msg("starting rank " + std::to_string(a_.rank()) + " of " + std::to_string(a_.world_size()) +
           (a_.resume_step() > 0 ? " from checkpoint step " + std::to_string(a_.resume_step())
                                 : std::string()));
}

void RankReporter::Ended(const JobOutcome& out, double seconds) {
  // Before the coordinator hears of the end: a scrape after it sees the job's gauges gone, and
  // a reader who sees the job ended finds every rank's result file.
  if (metrics_) metrics_->JobEnded(out.success, out.stopped, out.cancelled);
  {
    // A small result file: tests and operators read the final checksum without scraping logs.
    // Written whole under a temporary name, then renamed: never read half written.
    std::error_code ec;
    const std::filesystem::path dir = std::filesystem::path(data_dir_) / "results";
    std::filesystem::create_directories(dir, ec);
    const std::filesystem::path path =
        dir / (a_.job_id() + ".attempt" + std::to_string(a_.attempt()) + ".txt");
    const std::filesystem::path tmp = path.string() + ".tmp";
    {
      std::ofstream f(tmp);
      f << "job=" << a_.job_id() << "\nattempt=" << a_.attempt() << "\nrank=" << a_.rank()
        << "\nsuccess=" << (out.success ? 1 : 0) << "\nstopped=" << (out.stopped ? 1 : 0)
        << "\nsteps=" << out.steps << "\nchecksum=" << HexChecksum(out.checksum)
        << "\npolicy_version=" << out.policy_version << "\nfinished_unix_ms=" << NowUnixMs()
        << "\nreason=" << out.reason << "\n";
    }
    std::filesystem::rename(tmp, path, ec);
  }
  if (!out.stopped) Send(FinishedMessage(a_, out), true);
  {
    // Classified as WorkerMetrics::JobEnded counts it: a stop the coordinator sent for a cancel
    // (Stop.cause) is a cancel.
    const bool failed = !out.success && !out.stopped;
    log::Event e(failed ? log::Level::kError : log::Level::kInfo,
                 failed ? "rank.failed" : "rank.finished");
    e.F("job", a_.job_id()).F("attempt", a_.attempt()).F("rank", a_.rank()).F("step", out.steps);
    if (!failed) {
      e.F("result", out.success ? "succeeded" : out.cancelled ? "cancelled" : "stopped");
    }
    e.F("seconds", seconds).Msg(out.reason);
  }
}

}  // namespace geofp8::worker
