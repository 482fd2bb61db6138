// The bounds table and the reflection walk that applies it (bounds.h). Each bound leaves room
// for what the daemons send or a user types, and keeps any request far under gRPC's 4 MiB.
#include "proto/bounds.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/reflection.h>

#include <cinttypes>
#include <cstdio>
#include <limits>
#include <string>
#include <unordered_map>

namespace geofp8::bounds {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

constexpr size_t kKiB = 1024, kMiB = 1024 * 1024;
constexpr int64_t kMaxRank = 1023;  // world_size is at most 1024 (job_spec.h)

Bound Str(std::string_view field, size_t max_bytes, Chars chars) {
  Bound b;
  b.field = field;
  b.max_bytes = max_bytes;
  b.chars = chars;
  return b;
}
Bound Entries(std::string_view field, size_t max_entries) {
  Bound b;
  b.field = field;
  b.max_entries = max_entries;
  return b;
}
Bound Int(std::string_view field, int64_t min_value,
          int64_t max_value = std::numeric_limits<int64_t>::max()) {
  Bound b;
  b.field = field;
  b.min_value = min_value;
  b.max_value = max_value;
  return b;
}
// A repeated string: entries, and bytes of each.
Bound Strings(std::string_view field, size_t max_entries, size_t max_bytes, Chars chars) {
  Bound b = Str(field, max_bytes, chars);
  b.max_entries = max_entries;
  return b;
}

}  // namespace

std::string_view CharsName(Chars c) {
  switch (c) {
    case Chars::kBinary:
      return "any bytes";
    case Chars::kText:
      return "text without control codes (tab, newline, CR allowed)";
    case Chars::kLine:
      return "one line of text, no control codes";
    case Chars::kToken:
      return "printable ASCII without spaces";
    case Chars::kName:
      return "[A-Za-z0-9._-]";
    case Chars::kWorkerName:
      return "[A-Za-z0-9._:-]";
  }
  return "?";
}

const std::vector<Bound>& Table() {
  static const std::vector<Bound> table = {
      // Any message's field of this name, unless it has an entry of its own.
      Str("*.job_id", 64, Chars::kName),
      Str("*.worker_id", 200, Chars::kWorkerName),
      Str("*.session_secret", 128, Chars::kToken),
      Str("*.page_token", 64, Chars::kToken),
      Str("*.reason", 1 * kKiB, Chars::kLine),
      Str("*.layer", 512, Chars::kLine),
      Str("*.key", 1 * kKiB, Chars::kLine),  // KvLimits::max_key_bytes
      // JobService
      Str("SubmitJobRequest.spec_yaml", 1 * kMiB, Chars::kText),  // kMaxSpecBytes
      Str("SubmitJobRequest.idempotency_key", 128, Chars::kToken),
      Entries("ListJobsRequest.states", 16),
      Int("ListJobsRequest.limit", 0, 1000),
      Int("ListJobsRequest.page_size", 0, 1000),
      Str("ListJobsRequest.name", 63, Chars::kName),
      Str("DeleteJobRequest.name", 63, Chars::kName),
      Int("LogsRequest.rank", 0, kMaxRank),
      Int("LogsRequest.attempt", 0, std::numeric_limits<int32_t>::max()),
      Int("LogsRequest.tail_lines", 0, 1 << 30),
      // PolicyService
      Entries("UpdatePolicyRequest.patches", 256),  // kMaxPatchesPerUpdate
      Int("ListPolicyVersionsRequest.page_size", 0, 1000),
      // WorkerService
      Str("RegisterRequest.name", 200, Chars::kWorkerName),
      Str("RegisterRequest.host", 253, Chars::kToken),
      Str("RegisterRequest.device", 64, Chars::kToken),
      Entries("RegisterRequest.checkpoints", 64),
      Int("HeldCheckpoints.attempt", 0, std::numeric_limits<int32_t>::max()),
      Int("HeldCheckpoints.rank", 0, kMaxRank),
      Entries("HeldCheckpoints.steps", 1024),
      Entries("HeldCheckpoints.taken", 16384),
      Int("ListWorkersRequest.page_size", 0, 1000),
      // WorkerMessage and HookMessage bodies
      Entries("LayerCatalog.layers", 65536),
      Str("LayerCatalog.model_name", 256, Chars::kLine),
      Str("LayerInfo.name", 512, Chars::kLine),
      Entries("LayerSummaries.layers", 65536),
      Entries("ProbeResults.probes", 65536),
      Str("Checkpoint.path", 4 * kKiB, Chars::kLine),
      Str("JobFinished.reason", 4 * kKiB, Chars::kText),
      Str("LogData.data", 64 * kKiB, Chars::kBinary),  // a LogRead's max_bytes, capped
      Str("LogData.error", 4 * kKiB, Chars::kText),
      Str("RankAttach.job", 64, Chars::kName),
      Int("RankAttach.rank", 0, kMaxRank),
      Int("RankAttach.world_size", 0, kMaxRank + 1),
      Str("HookAttach.job", 64, Chars::kName),
      Int("HookAttach.rank", 0, kMaxRank),
      Int("HookAttach.world_size", 0, kMaxRank + 1),
      Str("HookAttach.token", 4 * kKiB, Chars::kToken),
      Str("HookFinished.reason", 4 * kKiB, Chars::kText),
      // RendezvousService
      Str("KvSetRequest.value", 1 * kMiB, Chars::kBinary),  // KvLimits::max_value_bytes
      Strings("KvWaitRequest.keys", 4096, 1 * kKiB, Chars::kLine),
      Int("KvGetRequest.wait_ms", 0),
      Int("KvWaitRequest.timeout_ms", 0),
  };
  return table;
}

namespace {

const std::unordered_map<std::string_view, const Bound*>& Index() {
  static const auto* index = [] {
    auto* m = new std::unordered_map<std::string_view, const Bound*>();
    for (const Bound& b : Table()) (*m)[b.field] = &b;
    return m;
  }();
  return *index;
}

std::string Path(const std::string& prefix, const FieldDescriptor* f, int index = -1) {
  std::string p = prefix.empty() ? std::string(f->name()) : prefix + "." + std::string(f->name());
  if (index >= 0) p += "[" + std::to_string(index) + "]";
  return p;
}

// Where s breaks its character set, as "byte 3 is 0x2f"; empty if it does not.
std::string CharsProblem(const std::string& s, Chars chars) {
  auto at = [](size_t i, unsigned char c) {
    char buf[48];
    std::snprintf(buf, sizeof buf, "byte %zu is 0x%02x", i, c);
    return std::string(buf);
  };
  for (size_t i = 0; i < s.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    switch (chars) {
      case Chars::kBinary:
        return "";
      case Chars::kText:
      case Chars::kLine: {
        const bool allowed_ws = chars == Chars::kText && (c == '\t' || c == '\n' || c == '\r');
        if ((c < 0x20 && !allowed_ws) || c == 0x7f) return at(i, c);
        // C1 controls (U+0080..U+009F: CSI and friends) are C2 80..C2 9F in UTF-8.
        if (c == 0xc2 && i + 1 < s.size()) {
          const unsigned char n = static_cast<unsigned char>(s[i + 1]);
          if (n >= 0x80 && n <= 0x9f) return at(i, c);
        }
        break;
      }
      case Chars::kToken:
        if (c <= 0x20 || c >= 0x7f) return at(i, c);
        break;
      case Chars::kName:
      case Chars::kWorkerName: {
        const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                        (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-' ||
                        (chars == Chars::kWorkerName && c == ':');
        if (!ok) return at(i, c);
        break;
      }
    }
  }
  return "";
}

absl::Status CheckString(const std::string& path, const std::string& s, const Bound& b) {
  if (s.size() > b.max_bytes) {
    return absl::InvalidArgumentError(path + ": at most " + std::to_string(b.max_bytes) +
                                      " bytes (" + std::to_string(s.size()) + ")");
  }
  if (std::string problem = CharsProblem(s, b.chars); !problem.empty()) {
    return absl::InvalidArgumentError(path + ": must be " + std::string(CharsName(b.chars)) + " (" +
                                      problem + ")");
  }
  return absl::OkStatus();
}

absl::Status CheckInt(const std::string& path, int64_t v, const Bound& b) {
  if (b.min_value && v < *b.min_value) {
    return absl::InvalidArgumentError(path + ": must be >= " + std::to_string(*b.min_value) + " (" +
                                      std::to_string(v) + ")");
  }
  if (b.max_value && v > *b.max_value) {
    return absl::InvalidArgumentError(path + ": must be <= " + std::to_string(*b.max_value) + " (" +
                                      std::to_string(v) + ")");
  }
  return absl::OkStatus();
}

absl::Status CheckUint(const std::string& path, uint64_t v, const Bound& b) {
  if (b.max_value && v > static_cast<uint64_t>(*b.max_value)) {
    return absl::InvalidArgumentError(path + ": must be <= " + std::to_string(*b.max_value) + " (" +
                                      std::to_string(v) + ")");
  }
  return absl::OkStatus();
}

absl::Status CheckEnum(const std::string& path, const FieldDescriptor* f, int v) {
  const auto* type = f->enum_type();
  if (type->FindValueByNumber(v) != nullptr) return absl::OkStatus();
  std::string accepted;
  for (int i = 0; i < type->value_count(); ++i) {
    accepted += (i ? ", " : "") + std::string(type->value(i)->name());
  }
  return absl::InvalidArgumentError(path + ": unknown " + std::string(type->full_name()) +
                                    " value (" + std::to_string(v) + "); accepted: " + accepted);
}

absl::Status Walk(const Message& m, const std::string& prefix, int depth) {
  if (depth > 16) return absl::InvalidArgumentError(prefix + ": nested too deep");
  const Reflection* r = m.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  const std::string message_name(m.GetDescriptor()->name());
  for (const FieldDescriptor* f : fields) {
    const bool is_bytes = f->type() == FieldDescriptor::TYPE_BYTES;
    const Bound b = BoundOf(message_name, f->name(), is_bytes);
    if (f->is_repeated()) {
      const int n = r->FieldSize(m, f);
      if (static_cast<size_t>(n) > b.max_entries) {
        return absl::InvalidArgumentError(Path(prefix, f) + ": at most " +
                                          std::to_string(b.max_entries) + " entries (" +
                                          std::to_string(n) + ")");
      }
      for (int i = 0; i < n; ++i) {
        absl::Status s;
        switch (f->cpp_type()) {
          case FieldDescriptor::CPPTYPE_STRING:
            s = CheckString(Path(prefix, f, i), r->GetRepeatedString(m, f, i), b);
            break;
          case FieldDescriptor::CPPTYPE_MESSAGE:
            s = Walk(r->GetRepeatedMessage(m, f, i), Path(prefix, f, i), depth + 1);
            break;
          case FieldDescriptor::CPPTYPE_ENUM:
            s = CheckEnum(Path(prefix, f, i), f, r->GetRepeatedEnumValue(m, f, i));
            break;
          case FieldDescriptor::CPPTYPE_INT32:
            s = CheckInt(Path(prefix, f, i), r->GetRepeatedInt32(m, f, i), b);
            break;
          case FieldDescriptor::CPPTYPE_INT64:
            s = CheckInt(Path(prefix, f, i), r->GetRepeatedInt64(m, f, i), b);
            break;
          case FieldDescriptor::CPPTYPE_UINT32:
            s = CheckUint(Path(prefix, f, i), r->GetRepeatedUInt32(m, f, i), b);
            break;
          case FieldDescriptor::CPPTYPE_UINT64:
            s = CheckUint(Path(prefix, f, i), r->GetRepeatedUInt64(m, f, i), b);
            break;
          default:
            break;
        }
        if (!s.ok()) return s;
      }
      continue;
    }
    absl::Status s;
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_STRING: {
        std::string scratch;
        s = CheckString(Path(prefix, f), r->GetStringReference(m, f, &scratch), b);
        break;
      }
      case FieldDescriptor::CPPTYPE_MESSAGE:
        s = Walk(r->GetMessage(m, f), Path(prefix, f), depth + 1);
        break;
      case FieldDescriptor::CPPTYPE_ENUM:
        s = CheckEnum(Path(prefix, f), f, r->GetEnumValue(m, f));
        break;
      case FieldDescriptor::CPPTYPE_INT32:
        s = CheckInt(Path(prefix, f), r->GetInt32(m, f), b);
        break;
      case FieldDescriptor::CPPTYPE_INT64:
        s = CheckInt(Path(prefix, f), r->GetInt64(m, f), b);
        break;
      case FieldDescriptor::CPPTYPE_UINT32:
        s = CheckUint(Path(prefix, f), r->GetUInt32(m, f), b);
        break;
      case FieldDescriptor::CPPTYPE_UINT64:
        s = CheckUint(Path(prefix, f), r->GetUInt64(m, f), b);
        break;
      default:
        break;
    }
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace

Bound BoundOf(std::string_view message_name, std::string_view field_name, bool is_bytes) {
  const auto& index = Index();
  std::string key = std::string(message_name) + "." + std::string(field_name);
  auto it = index.find(key);
  if (it == index.end()) it = index.find("*." + std::string(field_name));
  Bound b;
  if (it != index.end()) b = *it->second;
  if (it == index.end() && is_bytes) b.chars = Chars::kBinary;
  if (b.max_bytes == 0) b.max_bytes = kDefaultMaxBytes;
  if (b.max_entries == 0) b.max_entries = kDefaultMaxEntries;
  return b;
}

absl::Status Check(const Message& message) { return Walk(message, "", 0); }

std::string Fit(std::string text, std::string_view message_name, std::string_view field_name) {
  const Bound b = BoundOf(message_name, field_name, false);
  if (b.chars == Chars::kText || b.chars == Chars::kLine) {
    for (size_t i = 0; i < text.size(); ++i) {
      const std::string problem = CharsProblem(text.substr(i, 2), b.chars);
      if (problem.rfind("byte 0 ", 0) == 0) text[i] = '?';
    }
    // A C1 control's first byte became '?': its second (0x80-0x9f) is no UTF-8 on its own.
    for (size_t i = 0; i + 1 < text.size(); ++i) {
      const unsigned char n = static_cast<unsigned char>(text[i + 1]);
      if (text[i] == '?' && n >= 0x80 && n <= 0x9f) text[i + 1] = '?';
    }
  }
  if (text.size() > b.max_bytes) {
    size_t cut = b.max_bytes - 3;
    while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xc0) == 0x80) --cut;
    text.resize(cut);
    text += "...";
  }
  return text;
}

}  // namespace geofp8::bounds
