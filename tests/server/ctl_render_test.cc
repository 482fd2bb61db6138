// geofp8ctl rendering: durations, byte sizes, tables, the watch progress line, and that JSON and
// YAML output carry the same fields.
#include <gtest/gtest.h>

#include <algorithm>
#include <optional>
#include <sstream>

#include "client/ctl/render.h"
#include "yaml-cpp/yaml.h"

namespace geofp8::ctl {
namespace {

TEST(Render, DurationAndBytes) {
  EXPECT_EQ(Duration(0), "0s");
  EXPECT_EQ(Duration(59.4), "59s");
  EXPECT_EQ(Duration(90), "1m30s");
  EXPECT_EQ(Duration(3 * 3600 + 120), "3h02m");
  EXPECT_EQ(Duration(2 * 86400 + 3600), "2d01h");
  EXPECT_EQ(Duration(-1), "-");
  EXPECT_EQ(Bytes(512), "512 B");
  EXPECT_EQ(Bytes(1536), "1.5 KiB");
  EXPECT_EQ(Bytes(3.0 * (1 << 30)), "3.0 GiB");
}

TEST(Render, TableAlignsColumns) {
  EXPECT_EQ(Table({{"A", "BB"}, {"ccc", "d"}}), "A    BB\nccc  d\n");
}

// Issue #29: a reason holding a newline broke the table; every row stays one line.
TEST(Render, TableKeepsOneLinePerRow) {
  EXPECT_EQ(Table({{"NAME", "REASON"}, {"a", "failed:\n  line 2\r\n\tline 3"}, {"bb", "ok"}}),
            "NAME  REASON\na     failed: line 2 line 3\nbb    ok\n");
  v1::Job job;
  job.set_id("job-000001");
  job.set_name("j");
  job.set_state(v1::JOB_FAILED);
  job.set_reason("rank 0 failed:\nsecond line");
  const std::string table = JobsTable({job}, 0);
  EXPECT_EQ(std::count(table.begin(), table.end(), '\n'), 2) << table;
}

TEST(Render, ProgressLine) {
  v1::Job job;
  job.set_state(v1::JOB_RUNNING);
  auto* p = job.mutable_progress();
  p->set_step(249);  // the index of the last completed step: 250 done
  p->set_total_steps(1000);
  p->set_loss(3.25);
  p->set_tokens_per_second(12345);
  p->set_bytes_sent(1 << 20);
  p->set_bytes_baseline(4 << 20);
  const std::string line = ProgressLine(job, 5.0, 20);
  EXPECT_EQ(line.substr(0, 22), "[#####...............]");
  EXPECT_NE(line.find("250/1000"), std::string::npos) << line;
  EXPECT_NE(line.find(" 25%"), std::string::npos) << line;
  EXPECT_NE(line.find("loss 3.25"), std::string::npos) << line;
  EXPECT_NE(line.find("12.3k tok/s"), std::string::npos) << line;
  EXPECT_NE(line.find("saved 75% (3.0 MiB)"), std::string::npos) << line;
  EXPECT_NE(line.find("ETA 2m30s"), std::string::npos) << line;  // 750 steps at 5 steps/s
  EXPECT_NE(line.find("RUNNING"), std::string::npos) << line;
  EXPECT_NE(ProgressLine(job, 0, 20).find("ETA --"), std::string::npos);  // no rate yet
  // A finished job shows every step done, not the last step's index.
  job.set_state(v1::JOB_SUCCEEDED);
  p->set_step(999);
  EXPECT_NE(ProgressLine(job, 0, 20).find("1000/1000  100%"), std::string::npos)
      << ProgressLine(job, 0, 20);
  // Nothing reported yet: 0 done.
  job.set_state(v1::JOB_PENDING);
  p->set_step(0);
  EXPECT_NE(ProgressLine(job, 0, 20).find("0/1000"), std::string::npos);
}

// Issue #40 item 3: a job no rank has reported a step for (a program that crashes at start)
// shows no loss, rather than a loss of 0; once a report arrives its loss shows, 0 included.
TEST(Render, ALossNeverReportedShowsADash) {
  v1::Job job;
  job.set_id("job-7");
  job.set_state(v1::JOB_RUNNING);
  job.mutable_progress()->set_total_steps(100);
  EXPECT_NE(ProgressLine(job, 0, 20).find("  loss -  "), std::string::npos)
      << ProgressLine(job, 0, 20);
  EXPECT_NE(DescribeJob(job, nullptr, 0).find(", loss -, "), std::string::npos)
      << DescribeJob(job, nullptr, 0);
  // The LOSS column, the 9th of the wide table's row.
  auto wide_loss = [&job] {
    const std::string wide = JobsWideTable({job}, 0);
    std::istringstream row(wide.substr(wide.find('\n') + 1));
    std::string cell;
    for (int i = 0; i < 9; ++i) row >> cell;
    return cell;
  };
  job.set_name("j");
  EXPECT_EQ(wide_loss(), "-") << JobsWideTable({job}, 0);
  // Step 0's report, with its loss of 0.
  job.mutable_progress()->set_updated_unix_ms(1);
  EXPECT_NE(ProgressLine(job, 0, 20).find("  loss 0  "), std::string::npos)
      << ProgressLine(job, 0, 20);
  EXPECT_NE(DescribeJob(job, nullptr, 0).find(", loss 0.0000, "), std::string::npos);
  EXPECT_EQ(wide_loss(), "0") << JobsWideTable({job}, 0);
}

TEST(Render, DescribeShowsCheckpointsOffAndStepsDone) {
  v1::Job job;
  job.set_id("job-3");
  job.set_state(v1::JOB_SUCCEEDED);
  job.mutable_progress()->set_step(3999);
  job.mutable_progress()->set_total_steps(4000);
  job.set_spec_yaml("name: a\ntraining: {steps: 4000}\n");
  std::string out = DescribeJob(job, nullptr, 0);
  EXPECT_NE(out.find("Progress:     step 4000/4000"), std::string::npos) << out;
  EXPECT_NE(out.find("Checkpoint:   off\n"), std::string::npos) << out;
  job.set_spec_yaml("name: a\ntraining: {steps: 4000}\ncheckpoint: {dir: ckpt, every: 100}\n");
  job.mutable_progress()->set_checkpoint_step(3900);
  out = DescribeJob(job, nullptr, 0);
  EXPECT_NE(out.find("Checkpoint:   step 3900\n"), std::string::npos) << out;
}

TEST(Render, DescribeAndWideShowTheValidationLoss) {
  v1::Job job;
  job.set_id("job-4");
  job.set_state(v1::JOB_RUNNING);
  job.mutable_progress()->set_step(120);
  job.mutable_progress()->set_total_steps(400);
  std::string out = DescribeJob(job, nullptr, 0);
  EXPECT_NE(out.find("Validation:   -\n"), std::string::npos) << out;  // none measured yet
  EXPECT_NE(JobsWideTable({job}, 0).find("VAL-LOSS"), std::string::npos);
  job.mutable_progress()->set_val_loss(3.21875);
  job.mutable_progress()->set_val_step(99);  // measured after the 100th step
  out = DescribeJob(job, nullptr, 0);
  EXPECT_NE(out.find("Validation:   loss 3.2188 after step 100\n"), std::string::npos) << out;
  const std::string wide = JobsWideTable({job}, 0);
  EXPECT_NE(wide.find("3.219 @100"), std::string::npos) << wide;
}

// The noise scale, with the global batch it compares with for the built-in trainer.
TEST(Render, DescribeShowsTheNoiseScaleAgainstTheGlobalBatch) {
  v1::Job job;
  job.set_id("job-5");
  job.set_state(v1::JOB_RUNNING);
  job.set_world_size(2);
  job.set_spec_yaml("name: a\ntraining: {steps: 400, batch_size: 8, seq_len: 64}\n");
  std::string out = DescribeJob(job, nullptr, 0);
  EXPECT_NE(out.find("Noise scale:  -\n"), std::string::npos) << out;  // not reported yet
  job.mutable_progress()->set_gradient_noise_scale(2900.0);
  out = DescribeJob(job, nullptr, 0);
  // 2 ranks x 8 sequences x 64 tokens = 1024 tokens a step; 1024 / 2900 = 0.353.
  EXPECT_NE(out.find("Noise scale:  B_simple 2.9k tokens, global batch 1.02k tokens "
                     "(B/B_simple 0.35)\n"),
            std::string::npos)
      << out;
  job.set_spec_yaml("name: a\ncommand: [python3, train.py]\n");  // its own batch: unknown here
  out = DescribeJob(job, nullptr, 0);
  EXPECT_NE(out.find("Noise scale:  B_simple 2.9k tokens\n"), std::string::npos) << out;
}

// Policy history: the step each version was taken at, next to its effective step, in every output.
TEST(Render, PolicyHistoryShowsTheTakenStep) {
  v1::ListPolicyVersionsResponse r;
  auto add = [&](uint64_t version, int64_t effective, std::optional<int64_t> taken) {
    v1::Policy* p = r.add_policies();
    p->set_job_id("job-5");
    p->set_version(version);
    p->set_effective_step(effective);
    if (taken) p->set_taken_step(*taken);
    p->set_author(version == 1 ? "spec" : "user");
    p->set_reason("r" + std::to_string(version));
    p->mutable_default_policy()->set_format(v1::FORMAT_FP8_E4M3);
    p->mutable_default_policy()->set_geometry(v1::GEOMETRY_LOWRANK);
  };
  add(1, 0, 0);
  add(2, 45, std::nullopt);  // overtaken by v3 before the ranks took it: never in force
  add(3, 45, 47);            // taken two steps after its lower bound
  add(4, 90, std::nullopt);  // not taken yet
  const std::string table = PolicyHistoryTable(r);
  EXPECT_NE(table.find("VERSION  EFFECTIVE-STEP  TAKEN-STEP  AUTHOR"), std::string::npos) << table;
  EXPECT_NE(table.find("v1       0               0           spec"), std::string::npos) << table;
  EXPECT_NE(table.find("v2       45              never       user"), std::string::npos) << table;
  EXPECT_NE(table.find("v3       45              47          user"), std::string::npos) << table;
  EXPECT_NE(table.find("v4       90              -           user"), std::string::npos) << table;
  const std::string wide = PolicyHistoryWideTable(r, 0);
  EXPECT_NE(wide.find("TAKEN-STEP"), std::string::npos) << wide;
  EXPECT_NE(wide.find("fp8_e4m3/lowrank"), std::string::npos) << wide;
  EXPECT_NE(wide.find("v3       45              47"), std::string::npos) << wide;
  for (const YAML::Node& doc : {YAML::Load(ToJson(r)), YAML::Load(ToYaml(r))}) {
    const YAML::Node ps = doc["policies"];
    ASSERT_EQ(ps.size(), 4u);
    EXPECT_EQ(ps[0]["taken_step"].as<int64_t>(), 0);
    EXPECT_TRUE(ps[1]["taken_step"].IsNull());  // not "taken at step 0"
    EXPECT_EQ(ps[2]["taken_step"].as<int64_t>(), 47);
    EXPECT_EQ(ps[2]["effective_step"].as<int64_t>(), 45);
    EXPECT_TRUE(ps[3]["taken_step"].IsNull());
  }
  // JSON carries it as a number, not a string.
  EXPECT_NE(ToJson(r).find("\"taken_step\": 47"), std::string::npos) << ToJson(r);
}

TEST(Render, DescribeAndWatchShowACommandJob) {
  v1::Job job;
  job.set_id("job-4");
  job.set_state(v1::JOB_RUNNING);
  job.mutable_progress()->set_step(41);
  job.set_spec_yaml("name: a\ncommand: [python3, my train.py, --tag, \"it's\"]\n");
  std::string out = DescribeJob(job, nullptr, 0);
  EXPECT_NE(out.find("Command:      python3 'my train.py' --tag 'it'\\''s'\n"), std::string::npos)
      << out;
  // No training.steps: no total, and the program's checkpoints as it reports them.
  EXPECT_NE(out.find("Progress:     step 42/?"), std::string::npos) << out;
  EXPECT_NE(out.find("Checkpoint:   none reported\n"), std::string::npos) << out;
  const std::string line = ProgressLine(job, 5.0, 10);
  EXPECT_EQ(line.substr(0, 12), "[..........]") << line;
  EXPECT_NE(line.find("42/?"), std::string::npos) << line;
  EXPECT_NE(line.find("ETA --"), std::string::npos) << line;
  job.set_state(v1::JOB_SUCCEEDED);
  job.mutable_progress()->set_checkpoint_step(40);
  out = DescribeJob(job, nullptr, 0);
  EXPECT_NE(out.find("Progress:     step 42/?"), std::string::npos) << out;
  EXPECT_NE(out.find("Checkpoint:   step 40\n"), std::string::npos) << out;
}

// A command job's hook reports no residual error, geometry version or drift (issue #29): its
// layers show "-" for them, not 0; values it did report, and a built-in job's zeros, are shown.
TEST(Render, DescribeShowsUnreportedLayerFieldsOfACommandJobAsDash) {
  v1::Job job;
  job.set_id("job-5");
  job.set_state(v1::JOB_RUNNING);
  auto* l = job.add_layers();
  l->set_layer("fc1.weight");
  l->set_step(30);
  l->set_rel_fro_error(0.0312);
  auto* g = job.add_layers();
  g->set_layer("fc2.weight");
  g->set_step(30);
  g->set_rel_fro_error(0.02);
  g->set_residual_error(0.015);
  g->set_geometry_version(3);
  g->set_drift(0.25);
  job.set_spec_yaml("name: a\ncommand: [python3, train.py]\n");
  std::string out = DescribeJob(job, nullptr, 0);
  EXPECT_NE(out.find("  fc1.weight  30    0.0312     -               -           -\n"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("  fc2.weight  30    0.02       0.015           3           0.25\n"),
            std::string::npos)
      << out;
  // The built-in trainer reports all three: its zeros are values.
  job.set_spec_yaml("name: a\nmodel: {preset: llama-tiny}\n");
  out = DescribeJob(job, nullptr, 0);
  EXPECT_NE(out.find("  fc1.weight  30    0.0312     0               0           0\n"),
            std::string::npos)
      << out;
}

// `get -o json|yaml` says the same as describe: null where describe shows "-".
TEST(Render, DocumentsShowUnreportedLayerFieldsOfACommandJobAsNull) {
  v1::Job job;
  job.set_id("job-5");
  auto* l = job.add_layers();
  l->set_layer("fc1.weight");
  l->set_rel_fro_error(0.0312);
  auto* g = job.add_layers();
  g->set_layer("fc2.weight");
  g->set_residual_error(0.015);
  g->set_geometry_version(3);
  g->set_drift(0.25);
  job.set_spec_yaml("name: a\ncommand: [python3, train.py]\n");
  for (const std::string& text : {ToJson(job), ToYaml(job)}) {
    YAML::Node doc = YAML::Load(text);
    EXPECT_TRUE(doc["layers"][0]["residual_error"].IsNull()) << text;
    EXPECT_TRUE(doc["layers"][0]["geometry_version"].IsNull()) << text;
    EXPECT_TRUE(doc["layers"][0]["drift"].IsNull()) << text;
    EXPECT_EQ(doc["layers"][0]["rel_fro_error"].as<double>(), 0.0312) << text;
    EXPECT_EQ(doc["layers"][1]["residual_error"].as<double>(), 0.015) << text;
    EXPECT_EQ(doc["layers"][1]["geometry_version"].as<int>(), 3) << text;
    EXPECT_EQ(doc["layers"][1]["drift"].as<double>(), 0.25) << text;
  }
  // The built-in trainer's zeros are values.
  job.set_spec_yaml("name: a\nmodel: {preset: llama-tiny}\n");
  YAML::Node doc = YAML::Load(ToJson(job));
  EXPECT_EQ(doc["layers"][0]["residual_error"].as<double>(), 0.0);
  EXPECT_EQ(doc["layers"][0]["geometry_version"].as<int>(), 0);
}

// A command job's note (a program that has not attached to the hook) is a line of its own.
TEST(Render, DescribeShowsTheJobsNote) {
  v1::Job job;
  job.set_id("job-5");
  job.set_state(v1::JOB_RUNNING);
  job.set_reason("the programs of all 1 ranks started");
  EXPECT_EQ(DescribeJob(job, nullptr, 0).find("Note:"), std::string::npos);
  job.set_note("rank 0 has not attached to the GeoFP8 hook 120 s after its program started: ...");
  EXPECT_NE(DescribeJob(job, nullptr, 0)
                .find("Reason:       the programs of all 1 ranks started\n"
                      "Note:         rank 0 has not attached to the GeoFP8 hook 120 s after its "
                      "program started: ...\n"),
            std::string::npos)
      << DescribeJob(job, nullptr, 0);
}

TEST(Render, JsonAndYamlCarryTheSameFields) {
  v1::Job job;
  job.set_id("job-000007");
  job.set_state(v1::JOB_FAILED);
  job.set_world_size(4);
  job.mutable_progress()->set_step(12);
  YAML::Node from_json = YAML::Load(ToJson(job));
  YAML::Node from_yaml = YAML::Load(ToYaml(job));
  EXPECT_EQ(from_json["id"].as<std::string>(), "job-000007");
  EXPECT_EQ(from_yaml["id"].as<std::string>(), "job-000007");
  EXPECT_EQ(from_yaml["state"].as<std::string>(), "failed");
  EXPECT_EQ(from_yaml["world_size"].as<int>(), 4);
  EXPECT_EQ(from_yaml["progress"]["step"].as<std::string>(), "13");  // steps done: 0..12
  EXPECT_EQ(from_json.size(), from_yaml.size());
  EXPECT_EQ(ToYaml(job).find('{'), std::string::npos);  // block style, not flow
}

TEST(Render, DescribeShowsEventsAndPolicy) {
  v1::Job job;
  job.set_id("job-1");
  job.set_state(v1::JOB_PENDING);
  auto* e = job.add_events();
  e->set_state(v1::JOB_PENDING);
  e->set_message("PENDING: submitted");
  v1::Policy policy;
  policy.set_version(2);
  policy.set_effective_step(45);
  policy.mutable_default_policy()->set_format(v1::FORMAT_FP8_E4M3);
  auto* patch = policy.add_patches();
  patch->set_layer("*attn*");
  patch->set_format(v1::FORMAT_NVFP4);
  const std::string out = DescribeJob(job, &policy, 0);
  EXPECT_NE(out.find("PENDING: submitted"), std::string::npos) << out;
  EXPECT_NE(out.find("policy v2  effective at step 45"), std::string::npos) << out;
  EXPECT_NE(out.find("*attn*  format=nvfp4"), std::string::npos) << out;
}

TEST(Render, DescribeShowsTheAutoEnginesVerdictPerLayer) {
  v1::Job job;
  job.set_id("job-2");
  auto* on = job.add_layers();
  on->set_layer("layers.0.attn.wv");
  on->set_step(40);
  on->set_probe_step(50);
  on->set_probe_gain(1.8);
  on->set_probe_basis(v1::PROBE_BASIS_DEPLOYED);
  on->set_geometry_on(true);
  auto* off = job.add_layers();
  off->set_layer("layers.0.mlp.w2");
  off->set_step(40);
  off->set_probe_step(50);
  off->set_probe_gain(0.93);
  off->set_probe_basis(v1::PROBE_BASIS_SHADOW);
  auto* norm = job.add_layers();
  norm->set_layer("layers.0.attn_norm");
  norm->set_step(40);
  const std::string out = DescribeJob(job, nullptr, 0);
  EXPECT_NE(out.find("AUTO-GAIN  BASIS     PROBED  GEOMETRY"), std::string::npos) << out;
  EXPECT_NE(out.find("1.8        deployed  50      on"), std::string::npos) << out;
  EXPECT_NE(out.find("0.93       shadow    50      off"), std::string::npos) << out;
  EXPECT_NE(out.find("-          -         -       -"), std::string::npos) << out;
  // A job without probes keeps the plain table.
  job.clear_layers();
  *job.add_layers() = *norm;
  EXPECT_EQ(DescribeJob(job, nullptr, 0).find("AUTO-GAIN"), std::string::npos);
}

}  // namespace
// A restart backing off after failures in a row (#40 item 3): describe says when it is due.
TEST(Render, DescribeSaysWhenABackedOffRestartIsDue) {
  v1::Job job;
  job.set_id("job-6");
  job.set_state(v1::JOB_PENDING);
  job.set_scheduling(
      "backing off after 3 failed attempts in a row (CrashLoopBackOff): next try at "
      "2026-12-07T04:31:05.000Z");
  job.set_consecutive_failures(3);
  job.set_next_attempt_unix_ms(1'000'000 + 20'000);
  std::string out = DescribeJob(job, nullptr, 1'000'000);
  EXPECT_NE(out.find("Next try:     in 20.0 s, backing off after 3 failed attempts in a row\n"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("Scheduling:   backing off after 3"), std::string::npos) << out;
  // Once the time has come, or for a job that is not pending, no such line.
  EXPECT_EQ(DescribeJob(job, nullptr, 1'020'000).find("Next try:"), std::string::npos);
  job.set_state(v1::JOB_SCHEDULED);
  EXPECT_EQ(DescribeJob(job, nullptr, 1'000'000).find("Next try:"), std::string::npos);
}

}  // namespace geofp8::ctl
