// Rendering for geofp8ctl. JSON and YAML both print the Doc of the message (doc.h), so the two
// formats always carry the same fields with the same types.
#include "client/ctl/render.h"

#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "client/ctl/doc.h"
#include "platform/policy/job_spec.h"
#include "platform/policy/policy.h"

namespace geofp8::ctl {
namespace {

std::string Fmt(const char* fmt, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, fmt, v);
  return buf;
}

// "off" when the job's spec writes no checkpoints, else the last durable checkpoint's step.
std::string CheckpointText(const v1::Job& j) {
  auto spec = ParseJobSpec(j.spec_yaml());
  // A command job's program writes checkpoints of its own accord and reports them.
  if (spec.ok() && RunsOwnScript(*spec)) {
    return j.progress().checkpoint_step() > 0
               ? "step " + std::to_string(j.progress().checkpoint_step())
               : "none reported";
  }
  if (spec.ok() && (spec->checkpoint.every <= 0 || spec->checkpoint.dir.empty())) return "off";
  return "step " + std::to_string(j.progress().checkpoint_step());
}

// "N" or "?" when the job has no total (a command job without training.steps).
std::string TotalText(const v1::JobProgress& p) {
  return p.total_steps() > 0 ? std::to_string(p.total_steps()) : "?";
}

// The loss as `format` prints it, or "-" while no rank has reported a step: a job whose program
// crashes before its first step has no loss, not a loss of 0.
std::string LossText(const v1::JobProgress& p, const char* format) {
  const bool reported = p.updated_unix_ms() > 0 || p.step() > 0;
  return reported ? Fmt(format, p.loss()) : "-";
}

// "3.412 after step 200" or "-" before the first validation.
std::string ValidationText(const v1::JobProgress& p) {
  if (!p.has_val_loss()) return "-";
  return "loss " + Fmt("%.4f", p.val_loss()) + " after step " + std::to_string(p.val_step() + 1);
}

// "B_simple 2.9k tokens, global batch 4.1k tokens (B/B_simple 1.4)", or "-" before rank 0 reports
// one. The batch is the built-in trainer's (world size x batch_size x seq_len); a command job's
// program sets its own, so only B_simple is shown.
std::string NoiseScaleText(const v1::Job& j) {
  const v1::JobProgress& p = j.progress();
  if (!p.has_gradient_noise_scale() || !(p.gradient_noise_scale() > 0)) return "-";
  auto tokens = [](double t) {
    if (t >= 1e6) return Fmt("%.3gM", t / 1e6);
    if (t >= 1e3) return Fmt("%.3gk", t / 1e3);
    return Fmt("%.3g", t);
  };
  std::string out = "B_simple " + tokens(p.gradient_noise_scale()) + " tokens";
  auto spec = ParseJobSpec(j.spec_yaml());
  if (spec.ok() && !RunsOwnScript(*spec) && j.world_size() > 0) {
    const double batch =
        double(j.world_size()) * spec->training.batch_size * spec->training.seq_len;
    out += ", global batch " + tokens(batch) + " tokens (B/B_simple " +
           Fmt("%.2g", batch / p.gradient_noise_scale()) + ")";
  }
  return out;
}

// A command job's program and arguments, shell-quoted where needed; "" for the built-in trainer.
std::string CommandText(const v1::Job& j) {
  auto spec = ParseJobSpec(j.spec_yaml());
  if (!spec.ok()) return "";
  std::string out;
  for (const std::string& a : spec->command) {
    if (!out.empty()) out += " ";
    const bool plain =
        !a.empty() && a.find_first_of(" \t\n'\"\\$`*?[]{}()<>|&;#~") == std::string::npos;
    if (plain) {
      out += a;
      continue;
    }
    out += "'";
    for (char c : a) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
    out += "'";
  }
  return out;
}

std::string Age(int64_t since_ms, int64_t now_ms) {
  if (since_ms <= 0) return "-";
  return Duration(static_cast<double>(now_ms - since_ms) / 1000.0);
}

// A geometry as the job spec names it: lowrank+hadamard, hadamard, or the geometry alone.
std::string TransformNameOf(v1::GeometryMode g, bool hadamard) {
  if (!hadamard) return NameOf(g);
  return g == v1::GEOMETRY_NONE ? "hadamard" : NameOf(g) + "+hadamard";
}

std::string LayerFields(const v1::LayerPatch& p) {
  std::vector<std::string> parts;
  if (p.has_format()) parts.push_back("format=" + NameOf(p.format()));
  if (p.has_scaling()) parts.push_back("scaling=" + NameOf(p.scaling()));
  if (p.has_block()) parts.push_back("block=" + std::to_string(p.block()));
  if (p.has_rounding()) parts.push_back("rounding=" + NameOf(p.rounding()));
  if (p.has_geometry()) {
    parts.push_back("geometry=" + TransformNameOf(p.geometry(), p.has_hadamard() && p.hadamard()));
  }
  if (p.has_hadamard_block())
    parts.push_back("hadamard_block=" + std::to_string(p.hadamard_block()));
  if (p.has_rank()) parts.push_back("rank=" + std::to_string(p.rank()));
  if (p.has_alpha()) parts.push_back("alpha=" + Fmt("%g", p.alpha()));
  if (p.has_error_feedback())
    parts.push_back(std::string("error_feedback=") + (p.error_feedback() ? "on" : "off"));
  if (p.has_refresh_interval())
    parts.push_back("refresh_interval=" + std::to_string(p.refresh_interval()));
  std::string out;
  for (const auto& s : parts) out += (out.empty() ? "" : " ") + s;
  return out;
}

// A command job's program reports what its hook measures: geofp8.torch sends residual error 0
// and no geometry version or drift. Those zeros mean "not reported": describe shows "-", the
// documents null. The built-in trainer reports all three, so its zeros are values.
bool Unreported(bool command, double v) { return command && v == 0; }

}  // namespace

namespace {

Doc* Field(Doc* d, const std::string& key) {
  for (auto& [k, v] : d->fields) {
    if (k == key) return &v;
  }
  return nullptr;
}

// A job's steps in the document as the table shows them: progress.step is steps done (StepsDone;
// on the wire it is the index of the last step completed, so a finished 200-step job says 199),
// and val_step the steps done when the validation was measured ("after step N" in describe); a
// command job's unreported layer fields are null, as describe's "-" (Unreported).
void AdjustJob(const google::protobuf::Message& m, Doc* d) {
  const auto* job = dynamic_cast<const v1::Job*>(&m);
  if (!job) return;
  Doc* layers = Field(d, "layers");
  const bool command = !CommandText(*job).empty();
  for (int i = 0;
       command && layers && i < job->layers_size() && i < static_cast<int>(layers->items.size());
       ++i) {
    const v1::LayerSummary& l = job->layers(i);
    Doc* doc = &layers->items[static_cast<size_t>(i)];
    const std::pair<const char*, double> fields[] = {
        {"residual_error", l.residual_error()},
        {"geometry_version", double(l.geometry_version())},
        {"drift", l.drift()}};
    for (const auto& [name, v] : fields) {
      if (Doc* f = Field(doc, name); f && Unreported(command, v)) *f = Doc::Null();
    }
  }
  Doc* progress = Field(d, "progress");
  if (!progress || progress->kind != Doc::Kind::kObject) return;
  if (Doc* step = Field(progress, "step")) *step = Doc::Int(StepsDone(*job));
  if (Doc* val = Field(progress, "val_step"); val && job->progress().has_val_loss()) {
    *val = Doc::Int(job->progress().val_step() + 1);
  }
}

}  // namespace

Doc OutputDoc(const google::protobuf::Message& m) { return FromProto(m, AdjustJob); }

std::string ToJson(const google::protobuf::Message& m) { return DocToJson(OutputDoc(m)); }

std::string ToYaml(const google::protobuf::Message& m) { return DocToYaml(OutputDoc(m)); }

int64_t StepsDone(const v1::Job& j) {
  // progress.step is the index of the largest step any rank completed.
  const auto& p = j.progress();
  // A command job without training.steps has no total (0): its program decides when it is done.
  if (j.state() == v1::JOB_SUCCEEDED && p.total_steps() > 0) return p.total_steps();
  const int64_t done = j.state() == v1::JOB_RUNNING || p.step() > 0 ? p.step() + 1 : 0;
  return p.total_steps() > 0 ? std::min(done, p.total_steps()) : done;
}

// A cell on one line: every line break or tab, with the blanks around it, becomes one space (a
// reason may hold several lines; a row of the table must stay one).
std::string OneLineCell(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  bool in_break = false;
  for (char c : text) {
    const bool brk = c == '\n' || c == '\r' || c == '\t';
    if (brk) {
      while (!in_break && !out.empty() && out.back() == ' ') out.pop_back();
      if (!in_break) out += ' ';
      in_break = true;
    } else if (!(in_break && c == ' ')) {
      out += c;
      in_break = false;
    }
  }
  return out;
}

std::string Table(const std::vector<std::vector<std::string>>& raw) {
  std::vector<std::vector<std::string>> rows = raw;
  for (auto& row : rows) {
    for (auto& cell : row) cell = OneLineCell(cell);
  }
  std::vector<size_t> width;
  for (const auto& row : rows) {
    if (width.size() < row.size()) width.resize(row.size(), 0);
    for (size_t i = 0; i < row.size(); ++i) width[i] = std::max(width[i], row[i].size());
  }
  std::ostringstream os;
  for (const auto& row : rows) {
    std::string line;
    for (size_t i = 0; i < row.size(); ++i) {
      line += row[i];
      if (i + 1 < row.size()) line += std::string(width[i] - row[i].size() + 2, ' ');
    }
    while (!line.empty() && line.back() == ' ') line.pop_back();
    os << line << "\n";
  }
  return os.str();
}

std::string StateName(v1::JobState s) {
  std::string n = v1::JobState_Name(s);
  return n.rfind("JOB_", 0) == 0 ? n.substr(4) : n;
}

std::string WorkerStateName(v1::WorkerState s) {
  std::string n = v1::WorkerState_Name(s);
  return n.rfind("WORKER_", 0) == 0 ? n.substr(7) : n;
}

std::string Duration(double seconds) {
  if (seconds < 0 || !std::isfinite(seconds)) return "-";
  const int64_t s = static_cast<int64_t>(seconds + 0.5);
  char buf[64];
  if (s < 60) {
    std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(s));
  } else if (s < 3600) {
    std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  } else if (s < 86400) {
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(s / 3600),
                  static_cast<long long>((s % 3600) / 60));
  } else {
    std::snprintf(buf, sizeof buf, "%lldd%02lldh", static_cast<long long>(s / 86400),
                  static_cast<long long>((s % 86400) / 3600));
  }
  return buf;
}

std::string Bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::fabs(bytes) >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
  return buf;
}

std::string JobsTable(const std::vector<v1::Job>& jobs, int64_t now_ms) {
  std::vector<std::vector<std::string>> rows = {
      {"ID", "NAME", "STATE", "STEP", "WORLD", "RESTARTS", "POLICY", "AGE", "REASON"}};
  for (const auto& j : jobs) {
    rows.push_back({j.id(), j.name(), StateName(j.state()),
                    std::to_string(StepsDone(j)) + "/" + TotalText(j.progress()),
                    std::to_string(j.world_size()),
                    std::to_string(j.restarts()) + "/" + std::to_string(j.max_restarts()),
                    "v" + std::to_string(j.policy_version()), Age(j.created_unix_ms(), now_ms),
                    j.reason()});
  }
  return Table(rows);
}

std::string WorkersTable(const v1::ListWorkersResponse& workers, int64_t now_ms) {
  std::vector<std::vector<std::string>> rows = {
      {"ID", "STATE", "GEN", "JOB", "RANK", "DEVICE", "MEMORY", "STEP", "LAST-HEARTBEAT"}};
  for (const auto& w : workers.workers()) {
    rows.push_back({w.id(), WorkerStateName(w.state()), std::to_string(w.generation()),
                    w.job_id().empty() ? "-" : w.job_id(),
                    w.rank() >= 0 && !w.job_id().empty() ? std::to_string(w.rank()) : "-",
                    w.device().empty() ? "-" : w.device(),
                    w.memory_bytes() ? Bytes(static_cast<double>(w.memory_bytes())) : "-",
                    w.last_step() >= 0 ? std::to_string(w.last_step()) : "-",
                    Age(w.last_heartbeat_unix_ms(), now_ms) + " ago"});
  }
  return Table(rows);
}

std::string PolicyTable(const v1::Policy& p) {
  std::ostringstream os;
  os << "job " << p.job_id() << "  policy v" << p.version() << "  effective at step "
     << p.effective_step();
  if (p.has_taken_step()) os << ", taken at step " << p.taken_step();
  os << "  (" << p.author() << ": " << p.reason() << ")\n\n";
  const auto& d = p.default_policy();
  std::vector<std::vector<std::string>> rows = {
      {"LAYER", "FORMAT", "SCALING", "BLOCK", "ROUNDING", "GEOMETRY", "RANK", "ALPHA", "EF"},
      {"(default)", NameOf(d.format()), NameOf(d.scaling()), std::to_string(d.block()),
       NameOf(d.rounding()),
       TransformNameOf(d.geometry(), d.hadamard()) +
           (d.hadamard_block() ? "/" + std::to_string(d.hadamard_block()) : ""),
       std::to_string(d.rank()), Fmt("%g", d.alpha()), d.error_feedback() ? "on" : "off"}};
  os << Table(rows);
  if (p.patches_size() > 0) {
    os << "\npatches, applied in order:\n";
    std::vector<std::vector<std::string>> prow = {{"#", "LAYER", "FIELDS"}};
    for (int i = 0; i < p.patches_size(); ++i) {
      prow.push_back({std::to_string(i), p.patches(i).layer(), LayerFields(p.patches(i))});
    }
    os << Table(prow);
  }
  if (p.refresh_size() > 0) {
    os << "\ngeometry refresh schedule:\n";
    std::vector<std::vector<std::string>> rrow = {{"LAYER", "OWNER", "INTERVAL", "OFFSET"}};
    for (const auto& r : p.refresh()) {
      rrow.push_back({r.layer(), std::to_string(r.owner()), std::to_string(r.interval()),
                      std::to_string(r.offset())});
    }
    os << Table(rrow);
  }
  return os.str();
}

static std::string TakenStepText(const v1::ListPolicyVersionsResponse& versions, int index) {
  const v1::Policy& p = versions.policies(index);
  if (p.has_taken_step()) return std::to_string(p.taken_step());
  // Untaken but older than a taken version: a newer one overtook it and it was never in force.
  for (int i = index + 1; i < versions.policies_size(); ++i) {
    if (versions.policies(i).has_taken_step()) return "never";
  }
  return "-";  // not taken yet
}

std::string PolicyHistoryTable(const v1::ListPolicyVersionsResponse& versions) {
  std::vector<std::vector<std::string>> rows = {
      {"VERSION", "EFFECTIVE-STEP", "TAKEN-STEP", "AUTHOR", "PATCHES", "REASON"}};
  for (int i = 0; i < versions.policies_size(); ++i) {
    const v1::Policy& p = versions.policies(i);
    rows.push_back({"v" + std::to_string(p.version()), std::to_string(p.effective_step()),
                    TakenStepText(versions, i), p.author(), std::to_string(p.patches_size()),
                    p.reason()});
  }
  return Table(rows);
}

std::string PolicyHistoryWideTable(const v1::ListPolicyVersionsResponse& versions, int64_t now_ms) {
  std::vector<std::vector<std::string>> rows = {{"VERSION", "EFFECTIVE-STEP", "TAKEN-STEP",
                                                 "AUTHOR", "AGE", "DEFAULT", "PATCHES", "REFRESH",
                                                 "REASON"}};
  for (int i = 0; i < versions.policies_size(); ++i) {
    const v1::Policy& p = versions.policies(i);
    const v1::LayerPolicy& d = p.default_policy();
    std::string fields = d.format() == v1::FORMAT_UNSPECIFIED
                             ? "-"
                             : NameOf(d.format()) + "/" + NameOf(d.geometry());
    rows.push_back({"v" + std::to_string(p.version()), std::to_string(p.effective_step()),
                    TakenStepText(versions, i), p.author(), Age(p.created_unix_ms(), now_ms),
                    fields, std::to_string(p.patches_size()), std::to_string(p.refresh_size()),
                    p.reason()});
  }
  return Table(rows);
}

std::string DescribeJob(const v1::Job& j, const v1::Policy* policy, int64_t now_ms) {
  std::ostringstream os;
  const auto& pr = j.progress();
  os << "Job:          " << j.id() << "\n"
     << "Name:         " << j.name() << "\n"
     << "State:        " << StateName(j.state()) << "\n"
     << "Reason:       " << j.reason() << "\n";
  if (!j.note().empty()) os << "Note:         " << j.note() << "\n";
  if (j.state() == v1::JOB_PENDING && !j.scheduling().empty()) {
    os << "Scheduling:   " << j.scheduling() << "\n";
  }
  if (j.state() == v1::JOB_PENDING && j.next_attempt_unix_ms() > now_ms) {
    // A restart backing off after failures in a row (CrashLoopBackOff).
    os << "Next try:     in " << Fmt("%.1f", (j.next_attempt_unix_ms() - now_ms) / 1000.0)
       << " s, backing off after " << j.consecutive_failures() << " failed attempts in a row\n";
  }
  if (const std::string command = CommandText(j); !command.empty()) {
    os << "Command:      " << command << "\n";
  }
  if (auto spec = ParseJobSpec(j.spec_yaml()); spec.ok() && IsExternal(*spec)) {
    os << "Launcher:     external (its ranks attach to attach-only workers)\n";
  }
  os << "World size:   " << j.world_size() << "\n"
     << "Attempt:      " << j.attempt() << "  (restarts " << j.restarts() << "/" << j.max_restarts()
     << ")\n"
     << "Progress:     step " << StepsDone(j) << "/" << TotalText(pr) << ", loss "
     << LossText(pr, "%.4f") << ", " << Fmt("%.0f", pr.tokens_per_second()) << " tok/s\n"
     << "Validation:   " << ValidationText(pr) << "\n"
     << "Noise scale:  " << NoiseScaleText(j) << "\n"
     << "Checkpoint:   " << CheckpointText(j) << "\n";
  if (pr.bytes_baseline() > 0) {
    os << "Bytes:        sent " << Bytes(static_cast<double>(pr.bytes_sent())) << " of fp32 "
       << Bytes(static_cast<double>(pr.bytes_baseline())) << " (saved "
       << Fmt("%.1f", 100.0 * (1.0 - static_cast<double>(pr.bytes_sent()) /
                                         static_cast<double>(pr.bytes_baseline())))
       << "%)\n";
  }
  os << "Policy:       v" << j.policy_version() << "\n"
     << "Idempotency:  " << (j.idempotency_key().empty() ? "-" : j.idempotency_key()) << "\n"
     << "Created:      " << Age(j.created_unix_ms(), now_ms) << " ago\n";
  if (j.ranks_size() > 0) {
    os << "\nRanks:\n";
    std::vector<std::vector<std::string>> rows = {{"  RANK", "WORKER", "GEN"}};
    for (const auto& r : j.ranks()) {
      rows.push_back(
          {"  " + std::to_string(r.rank()), r.worker_id(), std::to_string(r.generation())});
    }
    os << Table(rows);
  }
  if (j.layers_size() > 0) {
    os << "\nLayers (latest summaries):\n";
    const bool probed = std::any_of(j.layers().begin(), j.layers().end(),
                                    [](const v1::LayerSummary& l) { return l.probe_step() > 0; });
    std::vector<std::vector<std::string>> rows = {
        {"  LAYER", "STEP", "REL-ERROR", "RESIDUAL-ERROR", "GEOMETRY-V", "DRIFT"}};
    // Auto jobs: the engine's latest judgement of each layer (gain with the basis it deploys, or
    // would deploy while off) and the state it left the layer in.
    if (probed) rows[0].insert(rows[0].end(), {"AUTO-GAIN", "BASIS", "PROBED", "GEOMETRY"});
    const bool command = !CommandText(j).empty();
    const auto reported = [command](double v, const std::string& text) {
      return Unreported(command, v) ? std::string("-") : text;
    };
    for (const auto& l : j.layers()) {
      rows.push_back({"  " + l.layer(), std::to_string(l.step()), Fmt("%.4g", l.rel_fro_error()),
                      reported(l.residual_error(), Fmt("%.4g", l.residual_error())),
                      reported(double(l.geometry_version()), std::to_string(l.geometry_version())),
                      reported(l.drift(), Fmt("%.3g", l.drift()))});
      if (!probed) continue;
      if (l.probe_step() > 0) {
        rows.back().insert(rows.back().end(),
                           {Fmt("%.3g", l.probe_gain()), ProbeBasisName(l.probe_basis()),
                            std::to_string(l.probe_step()), l.geometry_on() ? "on" : "off"});
      } else {
        rows.back().insert(rows.back().end(), {"-", "-", "-", "-"});
      }
    }
    os << Table(rows);
  }
  if (policy) os << "\n" << PolicyTable(*policy);
  if (j.events_size() > 0) {
    os << "\nEvents:\n";
    std::vector<std::vector<std::string>> rows = {{"  AGE", "STATE", "MESSAGE"}};
    for (const auto& e : j.events()) {
      rows.push_back({"  " + Age(e.unix_ms(), now_ms), StateName(e.state()), e.message()});
    }
    os << Table(rows);
  }
  return os.str();
}

std::string ProgressLine(const v1::Job& job, double steps_per_second, int bar_width) {
  const auto& p = job.progress();
  const double total = static_cast<double>(std::max<int64_t>(p.total_steps(), 1));
  const int64_t done = StepsDone(job);
  const double frac =
      p.total_steps() > 0 ? std::clamp(static_cast<double>(done) / total, 0.0, 1.0) : 0.0;
  const int filled = static_cast<int>(frac * bar_width + 0.5);
  std::string line = "[" + std::string(filled, '#') + std::string(bar_width - filled, '.') + "] ";
  line += std::to_string(done) + "/" + TotalText(p);
  line += "  " + (p.total_steps() > 0 ? Fmt("%3.0f%%", 100 * frac) : std::string("   -"));
  line += "  loss " + LossText(p, "%.4g");
  const double tps = p.tokens_per_second();
  line += "  " + (tps >= 1000 ? Fmt("%.1fk", tps / 1000) : Fmt("%.0f", tps)) + " tok/s";
  if (p.bytes_baseline() > 0) {
    const double saved =
        static_cast<double>(p.bytes_baseline()) - static_cast<double>(p.bytes_sent());
    line += "  saved " + Fmt("%.0f%%", 100 * saved / static_cast<double>(p.bytes_baseline())) +
            " (" + Bytes(saved) + ")";
  } else {
    line += "  saved -";
  }
  const double remaining = static_cast<double>(p.total_steps() - done);
  line += "  ETA " + (steps_per_second > 0 && p.total_steps() > 0
                          ? Duration(remaining / steps_per_second)
                          : std::string("--"));
  line += "  " + StateName(job.state());
  return line;
}

void StepRate::Add(double t_s, int64_t steps_done) {
  if (!samples_.empty() && (steps_done < samples_.back().second || t_s < samples_.back().first)) {
    samples_.clear();  // a restart from a checkpoint (or a clock step): measure afresh
  }
  if (!samples_.empty() && steps_done == samples_.back().second) return;  // no progress: no news
  samples_.emplace_back(t_s, steps_done);
  // Keep the newest sample older than the window too, so the window stays fully covered.
  size_t drop = 0;
  while (drop + 1 < samples_.size() && samples_[drop + 1].first <= t_s - window_s_) ++drop;
  samples_.erase(samples_.begin(), samples_.begin() + static_cast<std::ptrdiff_t>(drop));
}

double StepRate::Rate() const {
  if (samples_.size() < 2) return 0;
  const double span = samples_.back().first - samples_.front().first;
  if (span < min_span_s_) return 0;
  return static_cast<double>(samples_.back().second - samples_.front().second) / span;
}

bool WatchThrottle::ShouldPrint(const v1::Job& job) {
  bool print = first_ || job.state() != state_;
  first_ = false;
  state_ = job.state();
  const int64_t total = job.progress().total_steps();
  if (percent_ <= 0) return true;
  if (total > 0) {
    const int64_t bucket = static_cast<int64_t>(
        100.0 * static_cast<double>(StepsDone(job)) / static_cast<double>(total) / percent_ + 1e-9);
    if (bucket != bucket_) {
      // Only a bucket reached going forward is news; after a restart, the next one up is.
      print = print || bucket > bucket_;
      bucket_ = bucket;
    }
  }
  return print;
}

std::string JobsWideTable(const std::vector<v1::Job>& jobs, int64_t now_ms) {
  std::vector<std::vector<std::string>> rows = {{"ID", "NAME", "STATE", "STEP", "WORLD", "RESTARTS",
                                                 "POLICY", "AGE", "LOSS", "VAL-LOSS", "TOK/S",
                                                 "SAVED", "CHECKPOINT", "WORKERS", "REASON"}};
  for (const auto& j : jobs) {
    const auto& p = j.progress();
    std::string workers;
    for (const auto& r : j.ranks()) workers += (workers.empty() ? "" : ",") + r.worker_id();
    std::string saved = "-";
    if (p.bytes_baseline() > 0) {
      saved = Fmt("%.0f%%", 100.0 * (1.0 - static_cast<double>(p.bytes_sent()) /
                                               static_cast<double>(p.bytes_baseline())));
    }
    rows.push_back(
        {j.id(), j.name(), StateName(j.state()), std::to_string(StepsDone(j)) + "/" + TotalText(p),
         std::to_string(j.world_size()),
         std::to_string(j.restarts()) + "/" + std::to_string(j.max_restarts()),
         "v" + std::to_string(j.policy_version()), Age(j.created_unix_ms(), now_ms),
         LossText(p, "%.4g"),
         p.has_val_loss() ? Fmt("%.4g", p.val_loss()) + " @" + std::to_string(p.val_step() + 1)
                          : "-",
         Fmt("%.0f", p.tokens_per_second()), saved, CheckpointText(j),
         workers.empty() ? "-" : workers, j.reason()});
  }
  return Table(rows);
}

std::string WorkersWideTable(const v1::ListWorkersResponse& workers, int64_t now_ms) {
  std::vector<std::vector<std::string>> rows = {{"ID", "NAME", "HOST", "STATE", "GEN", "JOB",
                                                 "RANK", "DEVICE", "MEMORY", "STEP",
                                                 "LAST-HEARTBEAT"}};
  for (const auto& w : workers.workers()) {
    rows.push_back({w.id(), w.name().empty() ? "-" : w.name(), w.host().empty() ? "-" : w.host(),
                    WorkerStateName(w.state()), std::to_string(w.generation()),
                    w.job_id().empty() ? "-" : w.job_id(),
                    w.rank() >= 0 && !w.job_id().empty() ? std::to_string(w.rank()) : "-",
                    w.device().empty() ? "-" : w.device(),
                    w.memory_bytes() ? Bytes(static_cast<double>(w.memory_bytes())) : "-",
                    w.last_step() >= 0 ? std::to_string(w.last_step()) : "-",
                    Age(w.last_heartbeat_unix_ms(), now_ms) + " ago"});
  }
  return Table(rows);
}

namespace {

std::string Joined(const std::vector<std::string>& words) {
  std::string out;
  for (const auto& w : words) out += (out.empty() ? "" : " ") + w;
  return out;
}

// One `case` arm per command path ("" for the program itself, "get jobs", ...).
void CompletionCases(const CommandNode& node, const std::string& path,
                     const std::vector<std::pair<std::string, bool>>& inherited,
                     std::string* children, std::string* options, std::string* valued,
                     std::string* choices, std::string* jobs) {
  std::vector<std::pair<std::string, bool>> opts = inherited;
  for (const auto& o : node.options) {
    if (std::find(opts.begin(), opts.end(), o) == opts.end()) opts.push_back(o);
  }
  std::vector<std::string> names, all, with_value;
  for (const auto& c : node.children) names.push_back(c.name);
  for (const auto& [o, v] : opts) {
    all.push_back(o);
    if (v) with_value.push_back(o);
  }
  const std::string arm = "    \"" + path + "\") echo \"";
  if (!names.empty()) *children += arm + Joined(names) + "\" ;;\n";
  *options += arm + Joined(all) + "\" ;;\n";
  if (!with_value.empty()) *valued += arm + Joined(with_value) + "\" ;;\n";
  if (!node.choices.empty()) *choices += arm + Joined(node.choices) + "\" ;;\n";
  if (node.takes_job) *jobs += "    \"" + path + "\") return 0 ;;\n";
  for (const auto& c : node.children) {
    CompletionCases(c, path.empty() ? c.name : path + " " + c.name, opts, children, options, valued,
                    choices, jobs);
  }
}

}  // namespace

std::string CompletionScript(const CommandNode& root, const std::string& shell) {
  std::string children, options, valued, choices, jobs;
  CompletionCases(root, "", {}, &children, &options, &valued, &choices, &jobs);
  const std::string& p = root.name;
  std::string f = "_" + p;
  for (char& c : f) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  std::string s;
  if (shell == "zsh") {
    s += "#compdef " + p + "\n# zsh completion for " + p + " (generated by: " + p +
         " completion zsh). Load with: source <(" + p +
         " completion zsh)\n"
         "autoload -U +X compinit && compinit\n"
         "autoload -U +X bashcompinit && bashcompinit\n";
  } else {
    s += "# bash completion for " + p + " (generated by: " + p +
         " completion bash). Load with: source <(" + p + " completion bash)\n";
  }
  s += f + "_children() {\n  case \"$1\" in\n" + children + "  esac\n}\n";
  s += f + "_options() {\n  case \"$1\" in\n" + options + "  esac\n}\n";
  s += f + "_valued() {\n  case \"$1\" in\n" + valued + "  esac\n}\n";
  s += f + "_choices() {\n  case \"$1\" in\n" + choices + "  esac\n}\n";
  s += f + "_takes_job() {\n  case \"$1\" in\n" + jobs + "  esac\n  return 1\n}\n";
  s += f +
       "() {\n"
       "  local cur=\"${COMP_WORDS[COMP_CWORD]}\" path=\"\" skip=0 i w prev=\"\"\n"
       "  COMPREPLY=()\n"
       "  for ((i = 1; i < COMP_CWORD; i++)); do\n"
       "    w=\"${COMP_WORDS[i]}\"\n"
       "    if [ \"$skip\" = 1 ]; then skip=0; continue; fi\n"
       "    case \"$w\" in\n"
       "      --*=*) ;;\n"
       "      -*) [[ \" $(" +
       f +
       "_valued \"$path\") \" == *\" $w \"* ]] && skip=1; prev=\"$w\" ;;\n"
       "      *) [[ \" $(" +
       f +
       "_children \"$path\") \" == *\" $w \"* ]] && "
       "path=\"${path:+$path }$w\" ;;\n"
       "    esac\n"
       "  done\n"
       "  if [ \"$skip\" = 1 ]; then\n"
       "    case \"$prev\" in\n"
       "      -o|--output) COMPREPLY=($(compgen -W \"table wide name json yaml jsonpath=\" -- "
       "\"$cur\")) ;;\n"
       "      --context) COMPREPLY=($(compgen -W \"$(\"${COMP_WORDS[0]}\" config get-contexts "
       "-o name 2>/dev/null)\" -- \"$cur\")) ;;\n"
       "    esac\n"
       "    return 0\n"
       "  fi\n"
       "  if [[ \"$cur\" == -* ]]; then\n"
       "    COMPREPLY=($(compgen -W \"$(" +
       f +
       "_options \"$path\")\" -- \"$cur\"))\n"
       "    return 0\n"
       "  fi\n"
       "  local words\n"
       "  words=\"$(" +
       f + "_children \"$path\") $(" + f +
       "_choices \"$path\")\"\n"
       "  if " +
       f +
       "_takes_job \"$path\"; then\n"
       "    words=\"$words $(\"${COMP_WORDS[0]}\" get jobs -o "
       "jsonpath='{.jobs[*].id} {.jobs[*].name}' 2>/dev/null)\"\n"
       "  fi\n"
       "  COMPREPLY=($(compgen -W \"$words\" -- \"$cur\"))\n"
       "}\n"
       "complete -o default -F " +
       f + " " + p + "\n";
  return s;
}

}  // namespace geofp8::ctl
