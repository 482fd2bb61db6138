// Policy versions (compaction, the history bound, paging, taken steps), the layer catalog and
// refresh schedules, layer summaries and probes with the auto policy engine.
#include "server/coordinator/policy_book.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/util/message_differencer.h>

#include <algorithm>
#include <cstdio>
#include <deque>
#include <set>

#include "platform/common/log.h"
#include "platform/common/status.h"
#include "server/coordinator/policy_engine.h"

namespace geofp8::coordinator {
namespace {

// A version's patches are applied in order, field by field, so a field that a later patch with
// the same `layer` pattern sets again can never show: drop it, and drop patches left empty.
// Exact, needs no layer catalog, and keeps 1000 updates of one pattern at one patch.
void CompactPatches(google::protobuf::RepeatedPtrField<v1::LayerPatch>* patches) {
  std::map<std::string, std::set<int>> set_later;  // pattern -> field numbers set further on
  std::vector<v1::LayerPatch> kept;
  for (int i = patches->size() - 1; i >= 0; --i) {
    v1::LayerPatch p = patches->Get(i);
    const auto* reflection = p.GetReflection();
    std::vector<const google::protobuf::FieldDescriptor*> fields;
    reflection->ListFields(p, &fields);
    std::set<int>& later = set_later[p.layer()];
    bool any = false;
    for (const auto* f : fields) {
      if (f->number() == v1::LayerPatch::kLayerFieldNumber) continue;
      if (later.count(f->number())) {
        reflection->ClearField(&p, f);
      } else {
        later.insert(f->number());
        any = true;
      }
    }
    if (any) kept.push_back(std::move(p));
  }
  patches->Clear();
  for (auto it = kept.rbegin(); it != kept.rend(); ++it) *patches->Add() = std::move(*it);
}

// The name an unmatched glob's error gives a job's model: the one its program's catalog gives
// (LayerCatalog.model_name: GeoFP8State's model_name, by default the script's name); before a
// catalog, or from an older hook, the preset, or for a command job the program's script as its
// command line names it (issue #29: a command job has no preset).
// `python3 -u train.py --lr 1` -> "train.py", `python3 -m pkg.train` -> "pkg.train",
// `/opt/bin/trainer --x` -> "trainer".
std::string ModelNameForGlobs(const JobSpec& spec, const std::string& catalog_model) {
  if (!catalog_model.empty()) return catalog_model;
  if (!RunsOwnScript(spec)) return spec.model.preset;
  if (spec.command.empty()) return "the script";  // an external job: its launcher names it
  const auto base = [](const std::string& path) {
    const size_t slash = path.rfind('/');
    return slash == std::string::npos ? path : path.substr(slash + 1);
  };
  const std::string program = base(spec.command[0]);
  if (program.rfind("python", 0) == 0) {
    for (size_t i = 1; i < spec.command.size(); ++i) {
      const std::string& a = spec.command[i];
      if (a == "-m" && i + 1 < spec.command.size()) return spec.command[i + 1];
      if (a == "-c") break;  // inline code: no script to name
      if (!a.empty() && a[0] != '-') return base(a);
    }
  }
  return program.empty() ? "the program" : program;
}

// "" unless `spec` is a command job's and one of its policy.layers globs matches no layer of
// `catalog`: then "spec.policy.layers[I].match: matches no layer of SCRIPT (GLOB); ...", the
// message GeoFP8State gives for the same policy.
std::string CommandSpecGlobProblem(const JobSpec& spec, const v1::LayerCatalog& catalog) {
  if (!RunsOwnScript(spec) || catalog.layers().empty()) return "";
  std::vector<model::ParamInfo> layers;
  for (const auto& l : catalog.layers()) layers.push_back({.name = l.name()});
  for (size_t i = 0; i < spec.policy.layers.size(); ++i) {
    const std::string& glob = spec.policy.layers[i].match;
    if (glob.empty()) continue;
    if (std::string problem =
            UnmatchedGlobProblem(glob, layers, ModelNameForGlobs(spec, catalog.model_name()));
        !problem.empty()) {
      return "spec.policy.layers[" + std::to_string(i) + "].match: " + problem;
    }
  }
  return "";
}

// Index of the policy version in force at `step` among the n versions at(0) .. at(n - 1): the
// newest taken at or before it; for a job from an older coordinator, whose versions carry no
// taken_step, the newest effective by then.
template <typename At>
size_t InForceAtOf(size_t n, const At& at, int64_t step) {
  std::optional<size_t> taken;
  size_t legacy = 0;
  for (size_t v = 0; v < n; ++v) {
    const v1::Policy& p = at(v);
    if (p.has_taken_step() && p.taken_step() <= step) taken = v;
    if (!p.has_taken_step() && p.effective_step() <= step) legacy = v;
  }
  return taken ? *taken : legacy;
}

size_t InForceAt(const std::vector<v1::Policy>& policies, int64_t step) {
  return InForceAtOf(
      policies.size(), [&](size_t v) -> const v1::Policy& { return policies[v]; }, step);
}

// The versions an attempt resuming at `resume` can need, oldest first: the one in force there;
// the taken ones after it (replayed at their taken_step); and those after the newest taken one
// (the ranks take them when all hold them). A version older than a taken one that was never
// taken was overtaken and never in force. Of untaken versions sharing an effective step only the
// newest can be taken (a stalled job gives every update the same step), so only it is sent.
std::vector<size_t> PolicyHistory(const std::vector<v1::Policy>& policies, int64_t resume) {
  const size_t first = InForceAt(policies, resume);
  size_t newest_taken = first;
  for (size_t v = first; v < policies.size(); ++v) {
    if (policies[v].has_taken_step()) newest_taken = v;
  }
  std::vector<size_t> out = {first};
  for (size_t v = first + 1; v < policies.size(); ++v) {
    if (policies[v].has_taken_step()) {
      out.push_back(v);
      continue;
    }
    if (v < newest_taken) continue;
    if (v + 1 < policies.size() && !policies[v + 1].has_taken_step() &&
        policies[v + 1].effective_step() == policies[v].effective_step()) {
      continue;
    }
    out.push_back(v);
  }
  return out;
}

// The bytes `p` takes as one element of a repeated or singular message field: tag, length, body.
size_t FieldBytes(const v1::Policy& p) {
  const size_t body = p.ByteSizeLong();
  return 1 + google::protobuf::io::CodedOutputStream::VarintSize64(body) + body;
}

// FieldBytes of the durable version jp.versions[v], counted again only when its taken step
// changed (see VersionBytes).
size_t DurableFieldBytes(JobPolicies& jp, size_t v) {
  if (jp.bytes.size() < jp.versions.size()) jp.bytes.resize(jp.versions.size());
  const v1::Policy& p = jp.versions[v];
  const int64_t taken = p.has_taken_step() ? p.taken_step() : -1;
  VersionBytes& counted = jp.bytes[v];
  if (counted.bytes == 0 || counted.taken_step != taken) counted = {taken, FieldBytes(p)};
  return counted.bytes;
}

// RESOURCE_EXHAUSTED if `next` (of FieldBytes `next_bytes`), after the job's durable and staged
// versions, would take the bytes of policy versions the Assignments of an attempt resuming at
// `resume` can carry past kMaxPolicyHistoryBytes. Those are the latest version (`policy`), and
// every version from the one in force at `resume` (`policy_history`): PolicyHistory's versions
// and those it leaves out now but sends once the ranks take them, so taking versions never makes
// it grow.
absl::Status CheckHistoryBound(JobPolicies& jp, const v1::Policy& next, size_t next_bytes,
                               int64_t resume) {
  const size_t durable = jp.versions.size();
  const size_t n = durable + jp.staged.size() + 1;
  const auto at = [&](size_t v) -> const v1::Policy& {
    if (v < durable) return jp.versions[v];
    return v + 1 < n ? jp.staged[v - durable].policy : next;
  };
  const size_t first = InForceAtOf(n, at, resume);
  size_t bytes = next_bytes;  // the latest version, sent as `policy`
  for (size_t v = first; v < n; ++v) {
    if (v < durable) {
      bytes += DurableFieldBytes(jp, v);
    } else {
      bytes += v + 1 < n ? jp.staged[v - durable].field_bytes : next_bytes;
    }
  }
  if (bytes > kMaxPolicyHistoryBytes) {
    return absl::ResourceExhaustedError(
        "policy history: v" + std::to_string(next.version()) +
        " would bring the policy versions a resumed rank can need (v" +
        std::to_string(at(first).version()) + " to v" + std::to_string(next.version()) +
        ", from the recovery point at step " + std::to_string(resume) + ") to " +
        std::to_string(bytes) + " bytes, over the bound of " +
        std::to_string(kMaxPolicyHistoryBytes) +
        " bytes; versions before the one in force at the next checkpoint drop out, or patch "
        "broader globs");
  }
  return absl::OkStatus();
}

}  // namespace

PolicyBook::PolicyBook(Store* store, Clock* clock, JobTable* jobs, WorkerRegistry* workers)
    : store_(store), clock_(clock), jobs_(jobs), workers_(workers) {}

void PolicyBook::Load(std::vector<v1::Policy>& stored) {
  for (auto& p : stored) {
    if (!jobs_->FindOrNull(p.job_id())) continue;
    by_job_[p.job_id()].versions.push_back(std::move(p));
  }
}

absl::Status PolicyBook::PutFirst(const v1::Job& job, const JobSpec& spec, int64_t now,
                                  v1::Policy* first) {
  *first = InitialPolicy(job.id(), spec, now);
  return store_->PutPolicy(*first);
}

void PolicyBook::Add(const std::string& job_id, v1::Policy first) {
  by_job_[job_id].versions.push_back(std::move(first));
}

uint64_t PolicyBook::LatestVersion(const std::string& job_id) const {
  auto it = by_job_.find(job_id);
  return it == by_job_.end() || it->second.versions.empty() ? 0
                                                            : it->second.versions.back().version();
}

absl::StatusOr<v1::Policy> PolicyBook::Get(const JobRec& rec, uint64_t version) {
  const std::vector<v1::Policy>& policies = Of(rec.job.id()).versions;
  if (policies.empty()) return absl::InternalError("job " + rec.job.id() + " has no policy");
  if (version == 0) return policies.back();
  if (version > policies.size()) {
    return absl::NotFoundError("policy version " + std::to_string(version) + " of job " +
                               rec.job.id() + " not found (latest is " +
                               std::to_string(policies.size()) + ")");
  }
  return policies[version - 1];
}

absl::StatusOr<size_t> PolicyBook::PageSize(const v1::ListPolicyVersionsRequest& request) {
  if (request.page_size() < 0 || request.page_size() > kMaxPolicyPageSize) {
    return absl::InvalidArgumentError("page_size: must be in [0, " +
                                      std::to_string(kMaxPolicyPageSize) +
                                      "], 0 = " + std::to_string(kDefaultPolicyPageSize) + " (" +
                                      std::to_string(request.page_size()) + ")");
  }
  return request.page_size() == 0 ? kDefaultPolicyPageSize : request.page_size();
}

absl::StatusOr<v1::ListPolicyVersionsResponse> PolicyBook::ListVersions(
    const JobRec& rec, const std::string& page_token, size_t page_size) {
  const std::vector<v1::Policy>& policies = Of(rec.job.id()).versions;
  // The token is the number of the first version of the page, which never changes meaning:
  // versions are immutable and only ever appended.
  uint64_t first = 1;
  if (!page_token.empty()) {
    const std::string& t = page_token;
    const bool digits = t.size() <= 19 && std::all_of(t.begin(), t.end(),
                                                      [](char c) { return c >= '0' && c <= '9'; });
    first = digits ? std::stoull(t) : 0;
    if (first < 2 || first > policies.size()) {
      return absl::InvalidArgumentError("page_token: not a token this job's history issued (" +
                                        (t.size() <= 64 ? t : t.substr(0, 64) + "...") + ")");
    }
  }
  v1::ListPolicyVersionsResponse response;
  size_t bytes = 0;
  for (size_t v = first - 1; v < policies.size(); ++v) {
    const size_t add = FieldBytes(policies[v]);
    if (response.policies_size() > 0 && (response.policies_size() >= static_cast<int>(page_size) ||
                                         bytes + add > kMaxPolicyPageBytes)) {
      response.set_next_page_token(std::to_string(v + 1));
      break;
    }
    *response.add_policies() = policies[v];
    bytes += add;
  }
  return response;
}

absl::StatusOr<v1::Policy> PolicyBook::StagePolicyVersion(
    JobRec& rec, const std::vector<v1::LayerPatch>& patches, const std::string& reason,
    const std::string& author, Store::WriteHandle* write, const v1::LayerPolicy* default_policy,
    bool* unchanged) {
  JobPolicies& jp = Of(rec.job.id());
  // Made from the newest version, durable or staged: versions are numbered and submitted in
  // order, and each is written only after the one it was made from (Store::PutNextPolicy).
  const v1::Policy& latest = jp.staged.empty() ? jp.versions.back() : jp.staged.back().policy;
  v1::Policy next = latest;
  next.set_version(latest.version() + 1);
  next.clear_taken_step();  // not taken until rank 0 says so
  // Ranks that already passed the effective step would diverge, so it lies beyond the largest
  // step any rank has reported, by the job's margin.
  next.set_effective_step(rec.job.progress().step() + rec.spec.policy.margin);
  if (default_policy) *next.mutable_default_policy() = *default_policy;
  for (const auto& p : patches) *next.add_patches() = p;
  CompactPatches(next.mutable_patches());
  if (unchanged) {
    // Compaction keeps the last setting of every field per pattern, so re-appending patches the
    // version already ends with gives back the same list.
    *unchanged = google::protobuf::util::MessageDifferencer::Equals(next.default_policy(),
                                                                    latest.default_policy()) &&
                 next.patches_size() == latest.patches_size();
    for (int i = 0; *unchanged && i < next.patches_size(); ++i) {
      *unchanged =
          google::protobuf::util::MessageDifferencer::Equals(next.patches(i), latest.patches(i));
    }
    if (*unchanged) {
      // A staged latest is answered once it is durable (or with its failure).
      if (!jp.staged.empty()) *write = jp.staged.back().write;
      return latest;
    }
  }
  if (next.patches_size() > kMaxPatchesPerVersion) {
    return absl::ResourceExhaustedError(
        "patches: policy v" + std::to_string(next.version()) + " would hold " +
        std::to_string(next.patches_size()) + " patches after compaction, at most " +
        std::to_string(kMaxPatchesPerVersion) + "; patch broader globs or fewer distinct layers");
  }
  next.set_reason(reason);
  next.set_author(author);
  next.set_created_unix_ms(clock_->NowMs());
  next.clear_refresh();
  std::vector<v1::RefreshSchedule> schedules;
  if (!jp.catalog.empty()) {
    schedules = ComputeSchedules(jp.catalog, next, rec.job.world_size(), rec.spec.geometry_refresh);
    for (const auto& s : schedules) *next.add_refresh() = s;
  }
  // Every version a resumed rank may need travels in its Assignment; refuse the one that would
  // make that undeliverable (issue #31: 200 updates of 20 new globs made an 8 MB Assignment,
  // and every worker looped on gRPC's 4 MiB limit).
  const size_t next_bytes = FieldBytes(next);
  GEOFP8_RETURN_IF_ERROR(
      CheckHistoryBound(jp, next, next_bytes, rec.job.progress().checkpoint_step()));
  v1::JobEvent event;
  event.set_unix_ms(next.created_unix_ms());
  event.set_state(rec.job.state());
  event.set_message("policy v" + std::to_string(next.version()) + " effective at step " +
                    std::to_string(next.effective_step()) + " (" + author + "): " + reason);
  // The closure runs on whichever thread leads the batch, perhaps after the coordinator's mutex
  // was released: it holds copies only.
  v1::Job row = rec.job;
  row.set_policy_version(next.version());
  row.set_updated_unix_ms(next.created_unix_ms());
  *write = store_->Submit([store = store_, next, row = std::move(row), event]() -> absl::Status {
    GEOFP8_RETURN_IF_ERROR(store->PutNextPolicy(next));
    GEOFP8_RETURN_IF_ERROR(store->PutJob(row));
    return store->AppendEvent(row.id(), event);
  });
  jp.staged.push_back({next, event, std::move(schedules), *write, next_bytes});
  return next;
}

void PolicyBook::Publish(JobRec& rec, Outbox& out) {
  JobPolicies& jp = Of(rec.job.id());
  while (!jp.staged.empty()) {
    std::optional<absl::Status> result = store_->Result(jp.staged.front().write);
    if (!result) return;  // not yet durable, nor are the ones staged after it
    if (!result->ok()) {
      // The ones staged after it were made from it: their writes fail too (PutNextPolicy), and
      // the next version made takes its number.
      jp.staged.clear();
      return;
    }
    StagedPolicy staged = std::move(jp.staged.front());
    jp.staged.pop_front();
    const v1::Policy& next = staged.policy;
    if (!jp.catalog.empty()) jp.schedules = std::move(staged.schedules);
    rec.job.set_policy_version(next.version());
    rec.job.set_updated_unix_ms(next.created_unix_ms());
    rec.events.push_back(staged.event);
    jp.versions.push_back(next);
    log::Info("policy.changed")
        .F("job", rec.job.id())
        .F("version", next.version())
        .F("author", next.author())
        .F("effective_step", next.effective_step())
        .F("step", rec.job.progress().step())
        .F("patches", next.patches_size())
        .Msg(next.reason());
    ++policy_updates_;
    if (next.author() == "auto") ++auto_policy_updates_;
    v1::CoordinatorMessage m;
    *m.mutable_policy() = next;
    workers_->SendToRanks(rec.ranks, m, out);
    jobs_->Changed(rec);
  }
}

absl::StatusOr<v1::Policy> PolicyBook::AddPolicyVersion(JobRec& rec,
                                                        const std::vector<v1::LayerPatch>& patches,
                                                        const std::string& reason,
                                                        const std::string& author, Outbox& out) {
  Store::WriteHandle write;
  auto policy = StagePolicyVersion(rec, patches, reason, author, &write);
  if (!policy.ok() || !write) return policy;
  // Waits under the coordinator's mutex (the caller's state may be observed once this returns),
  // sharing a commit with whatever is queued.
  if (absl::Status s = store_->Wait(write); !s.ok()) {
    // The versions staged before it are durable and published by their own callers (into the
    // outboxes they flush); this one and those made from it are dropped.
    std::deque<StagedPolicy>& staged = Of(rec.job.id()).staged;
    staged.erase(std::find_if(staged.begin(), staged.end(),
                              [&](const StagedPolicy& p) { return p.write == write; }),
                 staged.end());
    return s;
  }
  Publish(rec, out);
  return policy;
}

absl::StatusOr<PolicyUpdate> PolicyBook::ParseUpdate(const v1::UpdatePolicyRequest& request) {
  if (request.patches_size() == 0 && !request.has_default_policy()) {
    return absl::InvalidArgumentError(
        "patches: at least one layer patch (or a default_policy) is required");
  }
  PolicyUpdate update;
  if (request.has_default_policy()) {
    GEOFP8_ASSIGN_OR_RETURN(auto typed, FromProto(request.default_policy(), "default_policy"));
    // A default replaces the whole policy: its values are taken as sent, never swapped for the
    // defaults (FromProto reads 0 as "unset", and a negative rank or a NaN would slip past).
    const v1::LayerPolicy& sent = request.default_policy();
    LayerPatchSpec ranges;
    ranges.match = "*";
    ranges.block = sent.block();
    ranges.rank = sent.rank();
    ranges.alpha = sent.alpha();
    typed.block = sent.block();
    typed.rank = sent.rank();
    typed.alpha = sent.alpha();
    if (std::string e = ValidateLayerPatch(ranges, "default_policy"); !e.empty()) {
      return absl::InvalidArgumentError(e);
    }
    update.default_policy = ToProto(typed);  // canonical form: every field set
  }
  if (request.patches_size() > kMaxPatchesPerUpdate) {
    return absl::InvalidArgumentError("patches: at most " + std::to_string(kMaxPatchesPerUpdate) +
                                      " per update (" + std::to_string(request.patches_size()) +
                                      ")");
  }
  for (int i = 0; i < request.patches_size(); ++i) {
    GEOFP8_ASSIGN_OR_RETURN(auto spec,
                            FromProto(request.patches(i), "patches[" + std::to_string(i) + "]"));
    update.patches.push_back(ToProto(spec));  // canonical form: only the fields that were set
  }
  return update;
}

absl::StatusOr<v1::UpdatePolicyResponse> PolicyBook::Update(JobRec& rec, const PolicyUpdate& update,
                                                            const std::string& reason,
                                                            Store::WriteHandle* write) {
  const std::vector<v1::LayerPatch>& patches = update.patches;
  if (JobTable::IsFinal(rec.job.state())) {
    return absl::FailedPreconditionError("job " + rec.job.id() + " is " +
                                         StateName(rec.job.state()) +
                                         "; its policy can no longer change");
  }
  // A pattern that names no layer is a typo that would do nothing. The layers are the ones
  // rank 0 reported, or before that the spec's model.
  const JobPolicies& jp = Of(rec.job.id());
  std::vector<model::ParamInfo> layers;
  for (const auto& l : jp.catalog) layers.push_back({.name = l.name()});
  // A command job's layers are known only from its script's catalog.
  if (layers.empty() && !RunsOwnScript(rec.spec)) {
    if (auto mc = model::PresetConfig(rec.spec.model.preset)) layers = model::ParamLayout(*mc);
  }
  for (size_t i = 0; i < patches.size() && !layers.empty(); ++i) {
    if (std::string problem = UnmatchedGlobProblem(patches[i].layer(), layers,
                                                   ModelNameForGlobs(rec.spec, jp.model_name));
        !problem.empty()) {
      return absl::InvalidArgumentError("patches[" + std::to_string(i) + "].layer: " + problem);
    }
  }
  bool unchanged = false;
  GEOFP8_ASSIGN_OR_RETURN(
      v1::Policy policy,
      StagePolicyVersion(rec, patches, reason.empty() ? "user update" : reason, "user", write,
                         update.default_policy ? &*update.default_policy : nullptr, &unchanged));
  v1::UpdatePolicyResponse response;
  *response.mutable_policy() = std::move(policy);
  response.set_unchanged(unchanged);
  return response;
}

void PolicyBook::OnCatalog(JobRec& rec, const v1::LayerCatalog& catalog, Outbox& out) {
  // A command job's spec globs are checked once its program names its layers, as the
  // built-in trainer's are at submit: one that matches nothing would do nothing.
  if (std::string problem = CommandSpecGlobProblem(rec.spec, catalog); !problem.empty()) {
    jobs_->FailAttempt(rec, problem, /*restartable=*/false, out);
    return;
  }
  JobPolicies& jp = Of(rec.job.id());
  jp.catalog.assign(catalog.layers().begin(), catalog.layers().end());
  jp.model_name = catalog.model_name();
  jp.schedules = ComputeSchedules(jp.catalog, jp.versions.back(), rec.job.world_size(),
                                  rec.spec.geometry_refresh);
  v1::CoordinatorMessage m;
  m.mutable_refresh()->set_job_id(rec.job.id());
  m.mutable_refresh()->set_policy_version(jp.versions.back().version());
  for (const auto& s : jp.schedules) *m.mutable_refresh()->add_schedules() = s;
  workers_->SendToRanks(rec.ranks, m, out);
}

void PolicyBook::OnSummaries(JobRec& rec, const v1::LayerSummaries& summaries) {
  JobPolicies& jp = Of(rec.job.id());
  for (const auto& l : summaries.layers()) {
    v1::LayerSummary& kept = jp.layers[l.layer()];
    if (l.step() < kept.step()) continue;
    const v1::LayerSummary probed = kept;  // the probe fields are the coordinator's own
    kept = l;
    kept.set_probe_step(probed.probe_step());
    kept.set_probe_gain(probed.probe_gain());
    kept.set_probe_basis(probed.probe_basis());
    kept.set_geometry_on(probed.geometry_on());
  }
}

absl::Status PolicyBook::OnProbes(JobRec& rec, const v1::ProbeResults& results, Outbox& out) {
  if (!rec.spec.auto_policy.enabled || JobTable::IsFinal(rec.job.state())) {
    return absl::OkStatus();
  }
  JobPolicies& jp = Of(rec.job.id());
  std::vector<v1::ProbeResult> probes(results.probes().begin(), results.probes().end());
  auto decisions =
      DecideAuto(rec.spec.auto_policy, rec.spec.geometry_refresh, jp.versions.back(), probes);
  if (!decisions.empty()) {
    std::vector<v1::LayerPatch> patches;
    std::string reason = "auto:";
    for (auto& d : decisions) {
      patches.push_back(d.patch);
      reason += " " + d.reason + ";";
    }
    reason.pop_back();
    auto s = AddPolicyVersion(rec, patches, reason, "auto", out);
    // At a bound the engine's decision waits for its next probe; the worker's message
    // was fine.
    if (!s.ok() && s.status().code() != absl::StatusCode::kResourceExhausted) {
      return s.status();
    }
    if (!s.ok()) {
      log::Warn("policy.refused")
          .F("job", rec.job.id())
          .F("author", "auto")
          .Msg(std::string(s.status().message()));
    }
  }
  // What `describe` shows per layer: the latest gain, its basis, and the state after the
  // decision (the engine's own record; summaries do not carry it).
  for (const auto& probe : probes) {
    if (probe.layer().empty() || !(probe.error_with() > 0)) continue;
    v1::LayerSummary& kept = jp.layers[probe.layer()];
    kept.set_layer(probe.layer());
    kept.set_probe_step(probe.step());
    kept.set_probe_gain(probe.error_without() / probe.error_with());
    kept.set_probe_basis(probe.basis());
    kept.set_geometry_on(ResolveLayer(jp.versions.back(), probe.layer()).policy.geometry() !=
                         v1::GEOMETRY_NONE);
  }
  return absl::OkStatus();
}

absl::Status PolicyBook::OnPolicyAck(JobRec& rec, const v1::PolicyAck& pa) {
  // Rank 0 says at which step the ranks took a version: a resumed attempt replays by it,
  // and OnProgress checks every rank against it.
  std::vector<v1::Policy>& policies = Of(rec.job.id()).versions;
  if (!pa.has_step() || pa.version() < 1 || pa.version() > policies.size() ||
      !JobTable::SameAttempt(rec, pa.job_id(), pa.attempt())) {
    return absl::OkStatus();
  }
  v1::Policy& taken = policies[pa.version() - 1];
  if (taken.has_taken_step() && taken.taken_step() == pa.step()) return absl::OkStatus();
  taken.set_taken_step(pa.step());
  GEOFP8_RETURN_IF_ERROR(store_->PutPolicy(taken));
  log::Info("policy.taken")
      .F("job", rec.job.id())
      .F("attempt", rec.job.attempt())
      .F("version", taken.version())
      .F("author", taken.author())
      .F("effective_step", taken.effective_step())
      .F("taken_step", taken.taken_step())
      .F("step", taken.taken_step())
      .Msg("the ranks put policy v" + std::to_string(taken.version()) + " in force at step " +
           std::to_string(taken.taken_step()));
  jobs_->Changed(rec);
  return absl::OkStatus();
}

void PolicyBook::RecordReportedTaken(JobRec& rec) {
  if (rec.interrupted_workers.empty()) return;
  const WorkerRec* w = workers_->Find(rec.interrupted_workers[0]);
  if (!w) return;
  std::vector<v1::Policy>& policies = Of(rec.job.id()).versions;
  for (const auto& h : w->held) {
    if (h.job_id() != rec.job.id() || h.attempt() != rec.interrupted_attempt || h.rank() != 0) {
      continue;
    }
    for (const auto& t : h.taken()) {
      if (!t.has_step() || t.version() < 1 || t.version() > policies.size()) continue;
      v1::Policy& p = policies[t.version() - 1];
      if (p.has_taken_step()) continue;  // rank 0's own report arrived: it is the record
      p.set_taken_step(t.step());
      if (auto s = store_->PutPolicy(p); !s.ok()) {
        p.clear_taken_step();
        std::fprintf(stderr, "geofp8-coordinator: %s\n", s.ToString().c_str());
        continue;
      }
      v1::JobEvent event;
      event.set_unix_ms(clock_->NowMs());
      event.set_state(rec.job.state());
      event.set_message("policy v" + std::to_string(t.version()) + " was taken at step " +
                        std::to_string(t.step()) + " in attempt " +
                        std::to_string(rec.interrupted_attempt) +
                        " (rank 0's report was lost; recorded from its re-registration)");
      jobs_->AppendEvent(rec, event);
      jobs_->Changed(rec);
    }
  }
}

void PolicyBook::ResendUntaken(const std::string& job_id, const std::shared_ptr<SessionSink>& sink,
                               Outbox& out) {
  auto it = by_job_.find(job_id);
  if (job_id.empty() || it == by_job_.end()) return;
  const std::vector<v1::Policy>& ps = it->second.versions;
  size_t from = 0;
  for (size_t v = 0; v < ps.size(); ++v) {
    if (ps[v].has_taken_step()) from = v + 1;
  }
  for (size_t v = from; v < ps.size(); ++v) {
    v1::CoordinatorMessage m;
    *m.mutable_policy() = ps[v];
    out.emplace_back(sink, std::move(m));
  }
}

void PolicyBook::FillAssignment(const std::string& job_id, v1::Assignment* base) {
  const std::vector<v1::Policy>& policies = Of(job_id).versions;
  *base->mutable_policy() = policies.back();
  for (size_t v : PolicyHistory(policies, base->resume_step())) {
    *base->add_policy_history() = policies[v];
  }
}

void PolicyBook::AddLayers(const std::string& job_id, v1::Job* job) const {
  auto it = by_job_.find(job_id);
  if (it == by_job_.end()) return;
  for (const auto& [name, summary] : it->second.layers) *job->add_layers() = summary;
}

}  // namespace geofp8::coordinator
