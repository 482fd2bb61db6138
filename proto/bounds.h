// Bounds on every field a geofp8.v1 request carries, checked where a request enters a daemon
// (the coordinator's gRPC adapters and session stream, the worker's hook server).
// One table of per-field bounds over a default, applied by walking the message with protobuf
// reflection: a field added to the proto is bounded without new code. docs/api-limits.md lists it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"

namespace google::protobuf {
class Message;
}

namespace geofp8::bounds {

// What a string may hold (protobuf has already checked that it is UTF-8).
enum class Chars {
  kBinary,      // bytes fields: anything
  kText,        // no control codes but tab, newline and carriage return (reasons, YAML)
  kLine,        // no control codes at all (C0, DEL, C1): one line of text
  kToken,       // printable ASCII without spaces (hosts, devices, keys, secrets, page tokens)
  kName,        // [A-Za-z0-9._-]: job names and ids
  kWorkerName,  // [A-Za-z0-9._:-]: worker names (host:pid by default)
};
std::string_view CharsName(Chars c);

// A field's bounds. Strings and bytes: max_bytes (each element of a repeated one); repeated
// fields: max_entries; integers: [min_value, max_value].
struct Bound {
  // "SubmitJobRequest.idempotency_key" (a message of geofp8.v1, then the field), or
  // "*.job_id" for every field of that name without an entry of its own.
  std::string_view field;
  size_t max_bytes = 0;    // 0: kDefaultMaxBytes
  size_t max_entries = 0;  // 0: kDefaultMaxEntries
  Chars chars = Chars::kLine;
  std::optional<int64_t> min_value;
  std::optional<int64_t> max_value;
};

// Any string or bytes field, and any repeated field, without an entry.
inline constexpr size_t kDefaultMaxBytes = 256;
inline constexpr size_t kDefaultMaxEntries = 1024;

// The table, in the order docs/api-limits.md lists it.
const std::vector<Bound>& Table();

// The bound that applies to `full_field_name` ("geofp8.v1.KvSetRequest.key"): its entry, the
// "*.name" entry, or the defaults (kLine strings, kBinary bytes).
Bound BoundOf(std::string_view message_name, std::string_view field_name, bool is_bytes);

// OK, or INVALID_ARGUMENT naming the first field past its bound with the bound and what it held:
// "idempotency_key: at most 128 bytes (1048576)", "checkpoints[0].steps: at most 1024 entries
// (100000)", "timeout_ms: must be >= 0 (-1)", "states[0]: unknown geofp8.v1.JobState value
// (99); accepted: ...", "name: must be characters of [A-Za-z0-9._:-] (byte 3 is 0x2f)".
// Every enum field must hold a value of its enum.
absl::Status Check(const google::protobuf::Message& message);

// Text a daemon composes itself (a failed rank's reason, which quotes what failed), made to fit
// `message_name.field_name`'s bound before it is sent: control codes the field's set refuses
// become '?', and text past the bound is cut at a UTF-8 boundary, ending in "...".
std::string Fit(std::string text, std::string_view message_name, std::string_view field_name);

}  // namespace geofp8::bounds
