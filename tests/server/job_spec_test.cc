// Job spec and policy patch parsing: defaults, every example file, and errors that name the field
// path and the YAML line.
#include "platform/policy/job_spec.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "tests/server/job_spec_error.h"

namespace geofp8 {
namespace {

std::string Read(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

TEST(JobSpec, MinimalSpecTakesDefaults) {
  auto spec = ParseJobSpec("name: a\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->name, "a");
  EXPECT_EQ(spec->world_size, 1);
  EXPECT_EQ(spec->backend, "gloo");
  EXPECT_EQ(spec->model.preset, "llama-tiny");
  EXPECT_EQ(spec->policy.defaults.format, Format::kFp8E4M3);
  EXPECT_EQ(spec->policy.margin, 5);
  EXPECT_EQ(spec->restarts.max_restarts, 3);
  EXPECT_EQ(spec->training.eval_every, 50);
  EXPECT_EQ(spec->training.eval_batches, 8);
}

TEST(JobSpec, FullSpecParsesEveryField) {
  auto spec = ParseJobSpec(R"(name: full
world_size: 4
backend: nccl
model: {preset: llama-small}
data: {source: file, path: data/x.txt, seed: 3}
training: {steps: 500, batch_size: 4, seq_len: 32, lr: 0.01, weight_decay: 0.1,
           warmup_steps: 10, optimizer: adamw, grad_clip: 0.5, seed: 9, eval_every: 25,
           eval_batches: 4}
exchange: {algorithm: native, bucket_mb: 4, timeout_s: 30}
policy:
  default: {format: nvfp4, scaling: tensor, block: 64, rounding: stochastic,
            geometry: diag, rank: 4, alpha: 0.5, error_feedback: true}
  layers:
    - {match: "*attn*", format: mxfp8, refresh_interval: 40}
  margin: 7
auto_policy: {enabled: true, probe_every: 10, min_gain: 2, off_gain: 1.2,
              max_cost_fraction: 0.2, geometry: lowrank, rank: 8, min_interval: 10,
              max_interval: 100, drift_low: 0.01, drift_high: 0.5}
geometry_refresh: {interval: 20, stagger: false}
checkpoint: {dir: ckpt, every: 50}
restarts: {max_restarts: 0}
)");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->world_size, 4);
  EXPECT_EQ(spec->data.path, "data/x.txt");
  EXPECT_EQ(spec->training.optimizer, "adamw");
  // sgd used to be accepted here and refused by every worker at run time.
  EXPECT_NE(ErrorOf("name: a\ntraining: {optimizer: sgd}\n")
                .find("line 2: spec.training.optimizer: unknown value (sgd); accepted: adamw"),
            std::string::npos);
  EXPECT_DOUBLE_EQ(spec->training.lr, 0.01);
  EXPECT_EQ(spec->training.eval_every, 25);
  EXPECT_EQ(spec->training.eval_batches, 4);
  EXPECT_EQ(spec->exchange.algorithm, Algorithm::kNative);
  EXPECT_EQ(spec->policy.defaults.format, Format::kNvfp4);
  EXPECT_EQ(spec->policy.defaults.scaling, Scaling::kTensor);
  EXPECT_EQ(spec->policy.defaults.rounding, Rounding::kStochastic);
  EXPECT_EQ(spec->policy.defaults.geometry, GeometryMode::kDiag);
  EXPECT_TRUE(spec->policy.defaults.error_feedback);
  ASSERT_EQ(spec->policy.layers.size(), 1u);
  EXPECT_EQ(spec->policy.layers[0].match, "*attn*");
  EXPECT_EQ(spec->policy.layers[0].format, Format::kMxfp8);
  EXPECT_FALSE(spec->policy.layers[0].geometry.has_value());
  EXPECT_EQ(spec->policy.layers[0].refresh_interval, 40);
  EXPECT_EQ(spec->policy.margin, 7);
  EXPECT_TRUE(spec->auto_policy.enabled);
  EXPECT_EQ(spec->auto_policy.max_interval, 100);
  EXPECT_FALSE(spec->geometry_refresh.stagger);
  EXPECT_EQ(spec->checkpoint.every, 50);
  EXPECT_EQ(spec->restarts.max_restarts, 0);
}

TEST(JobSpec, GeometryRefreshChoosesTheEstimatorAndItsCadence) {
  // The default is what geofp8-train's geometry presets ship: the ema sketch, fed every step.
  auto spec = ParseJobSpec("name: a\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->geometry_refresh.estimator, GeometryEstimator::kFactorEma);
  EXPECT_EQ(spec->geometry_refresh.interval, 1);
  EXPECT_FLOAT_EQ(spec->geometry_refresh.sketch.beta, 0.9f);
  EXPECT_EQ(spec->geometry_refresh.sketch.probe_every, 4);
  spec = ParseJobSpec(
      "name: a\ngeometry_refresh: {beta: 0.7, width: 16, probes: 2, probe_every: 1}\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_FLOAT_EQ(spec->geometry_refresh.sketch.beta, 0.7f);
  EXPECT_EQ(spec->geometry_refresh.sketch.width, 16);
  EXPECT_EQ(spec->geometry_refresh.sketch.probes, 2);
  EXPECT_EQ(spec->geometry_refresh.sketch.probe_every, 1);
  spec = ParseJobSpec("name: a\ngeometry_refresh: {probe_every: 0}\n");
  ASSERT_FALSE(spec.ok());
  EXPECT_NE(std::string(spec.status().message()).find("geometry_refresh.probe_every"),
            std::string::npos)
      << spec.status();
  // instant keeps its own default cadence, and an explicit one wins for either estimator.
  spec = ParseJobSpec("name: a\ngeometry_refresh: {estimator: instant}\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->geometry_refresh.estimator, GeometryEstimator::kInstant);
  EXPECT_EQ(spec->geometry_refresh.interval, 100);
  spec = ParseJobSpec("name: a\ngeometry_refresh: {interval: 7, estimator: instant}\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->geometry_refresh.interval, 7);
  // The auto engine's interval bounds constrain instant only (it never re-times a sketch).
  EXPECT_TRUE(ParseJobSpec("name: a\nauto_policy: {enabled: true}\n").ok());
  EXPECT_NE(ErrorOf("name: a\nauto_policy: {enabled: true}\n"
                    "geometry_refresh: {estimator: instant, interval: 10}\n")
                .find("spec.auto_policy.min_interval: must not exceed geometry_refresh.interval"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\ngeometry_refresh: {estimator: shampoo}\n")
                .find("line 2: spec.geometry_refresh.estimator: unknown value (shampoo)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\ngeometry_refresh: {estimator: instant, beta: 0.5}\n")
                .find("spec.geometry_refresh.beta: applies to estimator ema only (estimator "
                      "instant)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\ngeometry_refresh: {beta: 1}\n")
                .find("spec.geometry_refresh.beta: must be in [0, 0.999] (1)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\ngeometry_refresh: {width: 0}\n")
                .find("spec.geometry_refresh.width: must be in [1, 256] (0)"),
            std::string::npos);
}

TEST(JobSpec, AGlobThatMatchesNoLayerOfTheModelIsAnError) {
  const std::string e = ErrorOf(
      "name: a\nmodel: {preset: llama-tiny}\npolicy:\n  layers:\n"
      "    - {match: \"*attn*\", format: bf16}\n    - {match: \"*embed*\", format: bf16}\n");
  EXPECT_NE(e.find("line 6: spec.policy.layers[1].match: matches no layer of llama-tiny "
                   "(*embed*); its layers are tok_emb, layers.0.attn_norm, layers.0.attn.wq, "
                   "layers.0.attn.wk, layers.0.attn.wv, layers.0.attn.wo, layers.0.mlp_norm, "
                   "layers.0.mlp.w1, layers.0.mlp.w3, layers.0.mlp.w2, final_norm, lm_head, and "
                   "the same for each block layers.N"),
            std::string::npos)
      << e;
  EXPECT_EQ(e.find("layers[0]"), std::string::npos) << e;
  // The layout is the model's own: Model::params() lists exactly ParamLayout's names.
  const auto config = *model::PresetConfig("llama-tiny");
  const auto layout = model::ParamLayout(config);
  const model::Model<float> m(config);
  ASSERT_EQ(layout.size(), m.params().size());
  for (size_t i = 0; i < layout.size(); ++i) {
    EXPECT_EQ(layout[i].name, m.params()[i].name);
    EXPECT_EQ(layout[i].offset, m.params()[i].offset);
    EXPECT_EQ(layout[i].rows, m.params()[i].rows);
    EXPECT_EQ(layout[i].cols, m.params()[i].cols);
  }
}

TEST(JobSpec, PatchFilesRoundTripThroughTheirWriter) {
  PolicyPatchSpec patch;
  patch.reason = "tune: attention \"wide\" # not a comment";
  LayerPolicy d;
  d.format = Format::kNvfp4;
  d.scaling = Scaling::kTensor;
  d.block = 64;
  d.rounding = Rounding::kStochastic;
  d.geometry = GeometryMode::kLowRank;
  d.rank = 12;
  d.alpha = 0.1f;  // not exact in binary: the text must read back to the same float
  d.error_feedback = true;
  patch.defaults = d;
  LayerPatchSpec a;
  a.match = "layers.*.attn.w[qk]";
  a.format = Format::kMxfp8;
  a.alpha = 1.0f / 3.0f;
  a.refresh_interval = 40;
  LayerPatchSpec b;
  b.match = "*";
  b.error_feedback = false;
  b.geometry = GeometryMode::kNone;
  patch.layers = {a, b};
  const std::string text = WritePolicyPatch(patch, "a header\nover two lines");
  EXPECT_EQ(text.rfind("# a header\n# over two lines\n", 0), 0u) << text;
  auto back = ParsePolicyPatch(text);
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << text;
  EXPECT_EQ(back->reason, patch.reason);
  ASSERT_TRUE(back->defaults.has_value());
  const LayerPolicy& e = *back->defaults;
  EXPECT_EQ(e.format, d.format);
  EXPECT_EQ(e.scaling, d.scaling);
  EXPECT_EQ(e.block, d.block);
  EXPECT_EQ(e.rounding, d.rounding);
  EXPECT_EQ(e.geometry, d.geometry);
  EXPECT_EQ(e.rank, d.rank);
  EXPECT_EQ(e.alpha, d.alpha);
  EXPECT_EQ(e.error_feedback, d.error_feedback);
  ASSERT_EQ(back->layers.size(), 2u);
  EXPECT_EQ(back->layers[0].match, a.match);
  EXPECT_EQ(back->layers[0].format, a.format);
  EXPECT_EQ(back->layers[0].alpha, a.alpha);
  EXPECT_EQ(back->layers[0].refresh_interval, a.refresh_interval);
  EXPECT_FALSE(back->layers[0].scaling.has_value());
  EXPECT_EQ(back->layers[1].match, "*");
  EXPECT_EQ(back->layers[1].error_feedback, false);
  EXPECT_EQ(back->layers[1].geometry, GeometryMode::kNone);
  // A default alone is a valid patch file; nothing at all is not.
  EXPECT_TRUE(ParsePolicyPatch("default: {format: bf16}\n").ok());
  auto none = ParsePolicyPatch("reason: x\n");
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.status().message().find("patch.layers: required"), std::string::npos)
      << none.status();
}

TEST(JobSpec, EveryExampleJobParses) {
  int parsed = 0;
  for (const auto& e : std::filesystem::directory_iterator(GEOFP8_EXAMPLES_DIR)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("patch-", 0) == 0 || name == "invalid.yaml") continue;
    auto spec = ParseJobSpec(Read(e.path()));
    EXPECT_TRUE(spec.ok()) << name << ": " << spec.status();
    ++parsed;
  }
  EXPECT_GE(parsed, 3);
}

TEST(JobSpec, InvalidExampleReportsEveryFieldWithItsLine) {
  std::string e = ErrorOf(Read(std::filesystem::path(GEOFP8_EXAMPLES_DIR) / "invalid.yaml"));
  EXPECT_NE(e.find("line 2: spec.name:"), std::string::npos) << e;
  EXPECT_NE(e.find("line 3: spec.world_size: must be in [1, 1024] (0)"), std::string::npos) << e;
  EXPECT_NE(e.find("line 5: spec.training.lr: expected a number (fast)"), std::string::npos) << e;
  EXPECT_NE(e.find("line 6: spec.training.stepz: unknown field"), std::string::npos) << e;
  EXPECT_NE(e.find("line 9: spec.policy.default.format: unknown value (fp7)"), std::string::npos)
      << e;
}

TEST(JobSpec, HadamardPatchesRoundTripThroughTheWriterAndTheWire) {
  auto p = ParsePolicyPatch(
      "default: {format: nvfp4, geometry: lowrank+hadamard, hadamard_block: 8}\n"
      "layers:\n"
      "  - {match: a, geometry: hadamard, hadamard_block: 4}\n"
      "  - {match: b, geometry: diag}\n");
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->defaults->geometry, GeometryMode::kLowRank);
  EXPECT_TRUE(p->defaults->hadamard);
  EXPECT_EQ(p->defaults->hadamard_block, 8u);
  EXPECT_EQ(p->layers[0].geometry, GeometryMode::kNone);
  EXPECT_EQ(p->layers[0].hadamard, true);
  EXPECT_EQ(p->layers[0].hadamard_block, 4u);
  EXPECT_EQ(p->layers[1].geometry, GeometryMode::kDiag);
  EXPECT_EQ(p->layers[1].hadamard, false);
  EXPECT_FALSE(p->layers[1].hadamard_block.has_value());
  const std::string text = WritePolicyPatch(*p);
  EXPECT_NE(text.find("lowrank+hadamard"), std::string::npos) << text;
  auto back = ParsePolicyPatch(text);
  ASSERT_TRUE(back.ok()) << back.status() << "\n" << text;
  EXPECT_TRUE(back->defaults->hadamard);
  EXPECT_EQ(back->defaults->hadamard_block, 8u);
  EXPECT_EQ(back->layers[0].hadamard, true);
  EXPECT_EQ(back->layers[0].geometry, GeometryMode::kNone);
  EXPECT_EQ(back->layers[1].hadamard, false);
  LayerPatchSpec odd;
  odd.match = "x";
  odd.hadamard_block = 12;
  EXPECT_EQ(ValidateLayerPatch(odd, "p"),
            "p.hadamard_block: must be a power of two in [2, 4096] (12)");
}

TEST(JobSpec, ErrorsNameThePathAndLine) {
  EXPECT_NE(ErrorOf("world_size: 2\n").find("spec.name: required"), std::string::npos);
  EXPECT_NE(ErrorOf("name: a\nbackend: mpi\n").find("line 2: spec.backend: unknown value (mpi)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\nmodel:\n  preset: gpt5\n").find("line 3: spec.model.preset"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\npolicy:\n  layers:\n    - match: x\n      rank: 0\n")
                .find("line 5: spec.policy.layers[0].rank: must be in [1, 4096] (0)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\npolicy:\n  layers:\n    - format: bf16\n")
                .find("spec.policy.layers[0].match: required"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\ntraining:\n  steps: 10\n  warmup_steps: 10\n")
                .find("line 4: spec.training.warmup_steps: must be less than training.steps"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\ntraining:\n  eval_every: -1\n")
                .find("line 3: spec.training.eval_every: must be in [0, 1000000000] (-1)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\ntraining:\n  eval_batches: 0\n")
                .find("line 3: spec.training.eval_batches: must be in [1, 1024] (0)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\nexchange:\n  algorithm: native\n").find("native needs backend nccl"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\ncheckpoint:\n  every: 5\n").find("spec.checkpoint.dir: required"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\ndata:\n  source: file\n").find("spec.data.path: required"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\ntraining: 5\n").find("line 2: spec.training: expected a mapping (5)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\nauto_policy:\n  min_gain: 1.2\n  off_gain: 1.5\n")
                .find("spec.auto_policy.off_gain: must not exceed min_gain"),
            std::string::npos);
  EXPECT_NE(ErrorOf("- a\n- b\n").find("spec: expected a mapping"), std::string::npos);
  EXPECT_NE(ErrorOf("name: [unclosed\n").find("malformed YAML"), std::string::npos);
  EXPECT_NE(ErrorOf("name: a\nworld_size: 2.5\n")
                .find("spec.world_size: expected a decimal integer (2.5)"),
            std::string::npos);
}

TEST(PolicyPatch, ParsesAndValidates) {
  auto p =
      ParsePolicyPatch(Read(std::filesystem::path(GEOFP8_EXAMPLES_DIR) / "patch-attn-nvfp4.yaml"));
  ASSERT_TRUE(p.ok()) << p.status();
  ASSERT_EQ(p->layers.size(), 1u);
  EXPECT_EQ(p->layers[0].format, Format::kNvfp4);
  EXPECT_EQ(p->layers[0].geometry, GeometryMode::kLowRank);
  EXPECT_EQ(p->layers[0].refresh_interval, 200);
  EXPECT_FALSE(p->reason.empty());

  auto empty = ParsePolicyPatch("reason: x\n");
  ASSERT_FALSE(empty.ok());
  EXPECT_NE(empty.status().message().find("patch.layers: required"), std::string::npos);
  auto bad = ParsePolicyPatch("layers:\n  - match: a\n    geometry: svd\n");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("line 3: patch.layers[0].geometry: unknown value (svd)"),
            std::string::npos)
      << bad.status();
}

TEST(LayerMatches, ExactAndGlob) {
  EXPECT_TRUE(LayerMatches("blocks.0.attn.wq", "blocks.0.attn.wq"));
  EXPECT_TRUE(LayerMatches("blocks.*.attn.*", "blocks.3.attn.wo"));
  EXPECT_TRUE(LayerMatches("*", "anything"));
  EXPECT_TRUE(LayerMatches("blocks.?.mlp*", "blocks.1.mlp.up"));
  EXPECT_FALSE(LayerMatches("blocks.*.attn.*", "blocks.3.mlp.up"));
  EXPECT_FALSE(LayerMatches("embed", "embedding"));
}

TEST(Vocabulary, NamesRoundTrip) {
  for (auto f : {Format::kFp32, Format::kBf16, Format::kFp8E4M3, Format::kFp8E5M2, Format::kMxfp8,
                 Format::kNvfp4}) {
    EXPECT_EQ(ParseFormatName(FormatNameOf(f)), f);
  }
  for (auto g : {GeometryMode::kNone, GeometryMode::kDiag, GeometryMode::kLowRank}) {
    EXPECT_EQ(ParseGeometryName(GeometryNameOf(g)), g);
  }
  EXPECT_FALSE(ParseFormatName("fp8").has_value());
}

}  // namespace
}  // namespace geofp8

namespace geofp8 {
namespace {

TEST(JobSpec, CommandJobsRunAUserProgramInsteadOfTheTrainer) {
  auto spec = ParseJobSpec(
      "name: a\nworld_size: 2\ncommand: [python3, train.py, --lr, 0.1, '']\n"
      "policy:\n  layers:\n    - {match: 'fc*', format: nvfp4}\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->command, (std::vector<std::string>{"python3", "train.py", "--lr", "0.1", ""}));
  // No total unless given; globs are not checked against llama-tiny (the program's layers).
  EXPECT_EQ(spec->training.steps, 0);
  auto with_steps = ParseJobSpec("name: a\ncommand: [x]\ntraining: {steps: 50}\n");
  ASSERT_TRUE(with_steps.ok()) << with_steps.status();
  EXPECT_EQ(with_steps->training.steps, 50);
  EXPECT_TRUE(ParseJobSpec("name: a\n")->command.empty());
}

TEST(JobSpec, CommandErrorsNameTheFieldAndValue) {
  EXPECT_NE(ErrorOf("name: a\ncommand: []\n").find("line 2: spec.command: must not be empty"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\ncommand:\n").find("spec.command: expected a list of strings"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\ncommand: {a: b}\n").find("spec.command: expected a list"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\ncommand: [x, {a: b}]\n")
                .find("spec.command[1]: expected a string (a mapping)"),
            std::string::npos);
  EXPECT_NE(
      ErrorOf("name: a\ncommand: ['']\n").find("spec.command[0]: the program must not be empty"),
      std::string::npos);
  EXPECT_NE(
      ErrorOf("name: a\ncommand: [\"a\\0b\"]\n").find("spec.command[0]: must not contain a NUL"),
      std::string::npos);
  EXPECT_NE(ErrorOf("name: a\ncommand: [x, " + std::string(kMaxCommandArgBytes + 1, 'y') + "]\n")
                .find("spec.command[1]: at most 4096 bytes (yyyy"),
            std::string::npos);
  std::string many = "name: a\ncommand: [x";
  for (size_t i = 0; i < kMaxCommandArgs; ++i) many += ", y";
  EXPECT_NE(ErrorOf(many + "]\n").find("spec.command: at most 256 entries (257)"),
            std::string::npos);
  std::string big = "name: a\ncommand: [x";
  for (int i = 0; i < 10; ++i) big += ", " + std::string(4000, 'z');
  EXPECT_NE(ErrorOf(big + "]\n").find("spec.command: at most 32768 bytes in all"),
            std::string::npos);
  // The built-in trainer's fields are refused with a command, naming both.
  EXPECT_NE(ErrorOf("name: a\ncommand: [prog]\nmodel: {preset: llama-tiny}\n")
                .find("line 3: spec.model: not allowed with command (prog)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\ncommand: [prog]\ndata: {source: synthetic}\n")
                .find("line 3: spec.data: not allowed with command (prog)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\ncommand: [prog]\ntraining: {steps: 3, lr: 0.1}\n")
                .find("spec.training.lr: not allowed with command (accepted: steps)"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\ncommand: [prog]\ntraining: {steps: 0}\n")
                .find("spec.training.steps: must be in [1, 1000000000] (0)"),
            std::string::npos);
}

TEST(JobSpec, AnExternalJobTakesNoCommandModelOrData) {
  auto spec = ParseJobSpec("name: ext\nworld_size: 2\nlauncher: external\ntraining: {steps: 5}\n");
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(IsExternal(*spec));
  EXPECT_TRUE(RunsOwnScript(*spec));
  EXPECT_EQ(spec->training.steps, 5);
  EXPECT_FALSE(IsExternal(*ParseJobSpec("name: a\n")));
  EXPECT_NE(ErrorOf("name: a\nlauncher: slurm\n")
                .find("line 2: spec.launcher: unknown value (slurm); accepted: worker, external"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\nlauncher: external\ncommand: [prog]\n")
                .find("spec.command: not allowed with launcher: external"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\nlauncher: external\nmodel: {preset: llama-tiny}\n")
                .find("spec.model: not allowed with launcher: external"),
            std::string::npos);
  EXPECT_NE(ErrorOf("name: a\nlauncher: external\ntraining: {lr: 0.1}\n")
                .find("spec.training.lr: not allowed with launcher: external (accepted: steps)"),
            std::string::npos);
}

}  // namespace
}  // namespace geofp8
