// The bounds on request fields (proto/bounds.h, #41 item 1): every entry of the table holds at
// its limit and is refused one past it, naming the field, the bound and the length; character
// sets and unknown enums are refused; docs/api-limits.md lists every entry with its numbers; and
// the values the handlers used to replace (#41 item 2) are refused instead.
#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>

#include "geofp8/v1/geofp8.pb.h"
#include "proto/bounds.h"
#include "tests/server/coordinator_harness.h"

namespace geofp8::coordinator {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;

std::string Refusal(const Message& m) {
  const absl::Status s = bounds::Check(m);
  if (s.ok()) return "";
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  return std::string(s.message());
}

// A new message of the table entry's type, and the field it names ("*" entries: every message
// with a field of that name).
std::vector<std::pair<std::unique_ptr<Message>, const FieldDescriptor*>> Targets(
    const bounds::Bound& b) {
  std::vector<std::pair<std::unique_ptr<Message>, const FieldDescriptor*>> out;
  const std::string entry(b.field);
  const size_t dot = entry.find('.');
  const std::string type = entry.substr(0, dot), field = entry.substr(dot + 1);
  const auto* file = v1::Job::descriptor()->file();
  for (int i = 0; i < file->message_type_count(); ++i) {
    const auto* d = file->message_type(i);
    if (type != "*" && d->name() != type) continue;
    const FieldDescriptor* f = d->FindFieldByName(field);
    if (!f) continue;
    // A "*" entry is for the fields without an entry of their own.
    if (type == "*" && bounds::BoundOf(d->name(), field, false).field != b.field) continue;
    out.emplace_back(google::protobuf::MessageFactory::generated_factory()->GetPrototype(d)->New(),
                     f);
  }
  return out;
}

TEST(BoundsTest, EveryEntryHoldsAtItsLimitAndIsRefusedOnePast) {
  int checked = 0;
  for (const bounds::Bound& b : bounds::Table()) {
    const auto targets = Targets(b);
    ASSERT_FALSE(targets.empty()) << b.field << " names no field of geofp8.v1";
    for (const auto& [proto, f] : targets) {
      const std::string label = proto->GetDescriptor()->name() + "." + f->name();
      auto at = [&](int64_t n) {
        std::unique_ptr<Message> m(proto->New());
        const auto* r = m->GetReflection();
        if (f->is_repeated()) {
          for (int64_t i = 0; i < n; ++i) {
            if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
              r->AddMessage(m.get(), f);
            } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_STRING) {
              r->AddString(m.get(), f, "k");
            } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_ENUM) {
              r->AddEnumValue(m.get(), f, 1);
            } else {
              r->AddInt64(m.get(), f, 0);
            }
          }
        } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_STRING) {
          r->SetString(m.get(), f, std::string(n, 'a'));
        } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_INT32) {
          r->SetInt32(m.get(), f, static_cast<int32_t>(n));
        } else {
          r->SetInt64(m.get(), f, n);
        }
        return m;
      };
      if (f->is_repeated()) {
        const int64_t limit = b.max_entries ? b.max_entries : bounds::kDefaultMaxEntries;
        EXPECT_EQ(Refusal(*at(limit)), "") << label;
        EXPECT_EQ(Refusal(*at(limit + 1)), std::string(f->name()) + ": at most " +
                                               std::to_string(limit) + " entries (" +
                                               std::to_string(limit + 1) + ")")
            << label;
        ++checked;
      }
      if (!f->is_repeated() && f->cpp_type() == FieldDescriptor::CPPTYPE_STRING) {
        const int64_t limit = b.max_bytes ? b.max_bytes : bounds::kDefaultMaxBytes;
        EXPECT_EQ(Refusal(*at(limit)), "") << label;
        EXPECT_EQ(Refusal(*at(limit + 1)), std::string(f->name()) + ": at most " +
                                               std::to_string(limit) + " bytes (" +
                                               std::to_string(limit + 1) + ")")
            << label;
        ++checked;
      }
      if (b.min_value) {
        EXPECT_EQ(Refusal(*at(*b.min_value)), "") << label;
        EXPECT_EQ(Refusal(*at(*b.min_value - 1)),
                  std::string(f->name()) + ": must be >= " + std::to_string(*b.min_value) + " (" +
                      std::to_string(*b.min_value - 1) + ")")
            << label;
        ++checked;
      }
      if (b.max_value && *b.max_value < std::numeric_limits<int32_t>::max()) {
        EXPECT_EQ(Refusal(*at(*b.max_value)), "") << label;
        EXPECT_EQ(Refusal(*at(*b.max_value + 1)),
                  std::string(f->name()) + ": must be <= " + std::to_string(*b.max_value) + " (" +
                      std::to_string(*b.max_value + 1) + ")")
            << label;
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 40);
}

TEST(BoundsTest, NamesAndTextKeepToTheirCharacterSets) {
  v1::RegisterRequest reg;
  reg.set_name("host-1.example:4242");
  EXPECT_EQ(Refusal(reg), "");
  reg.set_name("a/b");
  EXPECT_EQ(Refusal(reg), "name: must be [A-Za-z0-9._:-] (byte 1 is 0x2f)");
  reg.set_name(std::string("a\0b", 3));
  EXPECT_EQ(Refusal(reg), "name: must be [A-Za-z0-9._:-] (byte 1 is 0x00)");
  reg.set_name("ok");
  reg.set_host("has space");
  EXPECT_EQ(Refusal(reg), "host: must be printable ASCII without spaces (byte 3 is 0x20)");

  v1::GetJobRequest get;
  get.set_job_id("job-1\x1b[2J");
  EXPECT_EQ(Refusal(get), "job_id: must be [A-Za-z0-9._-] (byte 5 is 0x1b)");

  v1::CancelJobRequest cancel;
  cancel.set_job_id("job-000001");
  cancel.set_reason("done, thanks \xe2\x9c\x93");  // UTF-8 is fine
  EXPECT_EQ(Refusal(cancel), "");
  cancel.set_reason("two\nlines");
  EXPECT_EQ(Refusal(cancel), "reason: must be one line of text, no control codes (byte 3 is 0x0a)");
  cancel.set_reason(
      "csi \xc2\x9b"
      "31m");  // U+009B, a C1 control
  EXPECT_EQ(Refusal(cancel), "reason: must be one line of text, no control codes (byte 4 is 0xc2)");

  v1::SubmitJobRequest submit;
  submit.set_spec_yaml("name: a\n\tworld_size: 1\r\n");  // text: tab, newline and CR allowed
  EXPECT_EQ(Refusal(submit), "");
  submit.set_spec_yaml("name: a\x07\n");
  EXPECT_EQ(Refusal(submit),
            "spec_yaml: must be text without control codes (tab, newline, CR allowed) (byte 7 is "
            "0x07)");

  // The worker's hook server checks HookMessage the same way: a layer name with an escape code.
  v1::HookMessage hook;
  hook.mutable_catalog()->add_layers()->set_name("layer\x1b");
  EXPECT_EQ(Refusal(hook),
            "catalog.layers[0].name: must be one line of text, no control codes "
            "(byte 5 is 0x1b)");
  // KV values are bytes: anything goes.
  v1::KvSetRequest kv;
  kv.set_key("job/0/rank0");
  kv.set_value(std::string("\0\x1b\xff", 3));
  EXPECT_EQ(Refusal(kv), "");
}

TEST(BoundsTest, UnknownEnumValuesAreRefusedWithTheAcceptedOnes) {
  v1::ListJobsRequest list;
  list.add_states(v1::JOB_RUNNING);
  list.add_states(static_cast<v1::JobState>(99));
  EXPECT_EQ(Refusal(list),
            "states[1]: unknown geofp8.v1.JobState value (99); accepted: JOB_STATE_UNSPECIFIED, "
            "JOB_PENDING, JOB_SCHEDULED, JOB_RUNNING, JOB_SUCCEEDED, JOB_FAILED, JOB_CANCELLED");
  v1::LogsRequest logs;
  logs.set_job_id("job-000001");
  logs.set_stream(static_cast<v1::LogStream>(2));
  EXPECT_EQ(Refusal(logs),
            "stream: unknown geofp8.v1.LogStream value (2); accepted: LOG_STDOUT, LOG_STDERR");
  v1::UpdatePolicyRequest update;
  update.add_patches()->set_format(static_cast<v1::Format>(-3));
  EXPECT_NE(Refusal(update).find("patches[0].format: unknown geofp8.v1.Format value (-3)"),
            std::string::npos);
}

// What a daemon composes itself (a failed rank's reason quoting an error) is made to fit before
// it is sent, so the coordinator never refuses the worker's own report.
TEST(BoundsTest, FitMakesADaemonsOwnTextFitItsField) {
  const std::string fitted = bounds::Fit("gloo: \x1b[31mreset\xc2\x9b\n\t" + std::string(5000, 'y'),
                                         "JobFinished", "reason");
  EXPECT_EQ(fitted.size(), 4096u);
  EXPECT_EQ(fitted.substr(0, 20), "gloo: ?[31mreset??\n\t");
  EXPECT_EQ(fitted.substr(4093), "...");
  v1::JobFinished finished;
  finished.set_reason(fitted);
  EXPECT_EQ(Refusal(finished), "");
  // Cut at a UTF-8 boundary: 3000 two-byte characters.
  std::string accents;
  for (int i = 0; i < 3000; ++i) accents += "\xc3\xa9";
  const std::string cut = bounds::Fit(accents, "JobFinished", "reason");
  EXPECT_EQ(cut.size(), 4092u + 3);
  EXPECT_EQ(cut.substr(4090, 2), "\xc3\xa9");
}

// docs/api-limits.md has a row per entry, with its bound as the table has it.
TEST(BoundsTest, TheDocsListEveryEntry) {
  std::ifstream in(GEOFP8_DOCS_DIR "/api-limits.md");
  ASSERT_TRUE(in) << GEOFP8_DOCS_DIR "/api-limits.md";
  std::stringstream doc;
  doc << in.rdbuf();
  const std::string text = doc.str();
  for (const bounds::Bound& b : bounds::Table()) {
    std::string row = "| `" + std::string(b.field) + "` | ";
    if (b.max_bytes)
      row += std::to_string(b.max_bytes) + " bytes, " + std::string(bounds::CharsName(b.chars));
    if (b.max_entries)
      row += std::string(b.max_bytes ? "; " : "") + std::to_string(b.max_entries) + " entries";
    if (b.min_value) {
      row += ">= " + std::to_string(*b.min_value);
      if (b.max_value && *b.max_value != std::numeric_limits<int64_t>::max()) {
        row += ", <= " + std::to_string(*b.max_value);
      }
    }
    row += " |";
    EXPECT_NE(text.find(row), std::string::npos) << "docs/api-limits.md lacks the row " << row;
  }
  for (const std::string& defaults :
       {"| any other string | " + std::to_string(bounds::kDefaultMaxBytes) +
            " bytes, one line of text, no control codes |",
        "| any other bytes field | " + std::to_string(bounds::kDefaultMaxBytes) +
            " bytes, any bytes |",
        "| any other repeated field | " + std::to_string(bounds::kDefaultMaxEntries) +
            " entries |"}) {
    EXPECT_NE(text.find(defaults), std::string::npos) << defaults;
  }
}

// #41 item 2: a default_policy's values are taken as sent, never replaced by the defaults.
class InvalidValuesTest : public CoordinatorHarness {};

TEST_F(InvalidValuesTest, ADefaultPolicyWithAnInvalidValueIsRefusedNotReplaced) {
  const std::string id = Submit("name: j\nworld_size: 1\n");
  auto update = [&](auto change) {
    v1::UpdatePolicyRequest req;
    req.set_job_id(id);
    v1::LayerPolicy* d = req.mutable_default_policy();
    d->set_format(v1::FORMAT_FP8_E5M2);
    d->set_scaling(v1::SCALING_BLOCK);
    d->set_block(64);
    d->set_rank(8);
    d->set_alpha(0.5f);
    change(d);
    return coordinator->UpdatePolicy(req);
  };
  auto rank = update([](v1::LayerPolicy* d) { d->set_rank(-1); });
  EXPECT_EQ(rank.status().message(), "default_policy.rank: must be in [1, 4096] (-1)");
  auto block = update([](v1::LayerPolicy* d) { d->set_block(0); });
  EXPECT_EQ(block.status().message(), "default_policy.block: must be in [1, 1048576] (0)");
  auto alpha = update([](v1::LayerPolicy* d) { d->set_alpha(std::nanf("")); });
  EXPECT_NE(alpha.status().message().find("default_policy.alpha: must be in [0, 1]"),
            std::string::npos)
      << alpha.status();
  EXPECT_EQ(Get(id).policy_version(), 1u);  // none of them made a version
  // Zero is a valid alpha and stays zero.
  auto zero = update([](v1::LayerPolicy* d) { d->set_alpha(0); });
  ASSERT_TRUE(zero.ok()) << zero.status();
  EXPECT_EQ(zero->policy().default_policy().alpha(), 0.f);
  EXPECT_EQ(zero->policy().default_policy().block(), 64u);
}

TEST_F(InvalidValuesTest, NegativeKvWaitsAreRefused) {
  const absl::Status wait = coordinator->kv().Wait("job-000001", {"k"}, -1);
  EXPECT_EQ(wait.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(wait.message(), "timeout_ms: must be >= 0, 0 = 30000 (-1)");
  const auto get = coordinator->kv().Get("job-000001", "k", -5);
  EXPECT_EQ(get.status().message(), "wait_ms: must be >= 0 (-5)");
}

}  // namespace
}  // namespace geofp8::coordinator
