// A small document tree for geofp8ctl's structured output: a protobuf message becomes a Doc
// (field names as in the .proto, every field present, enums by name), which prints as JSON with
// 64-bit integers as numbers, as block YAML whose strings stay strings on reading (`true`, `1.5`,
// `null`, `0x1` are quoted), or through a JSONPath template (`-o jsonpath=...`).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"

namespace geofp8::ctl {

struct Doc {
  enum class Kind { kNull, kBool, kInt, kUint, kDouble, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool b = false;
  int64_t i = 0;
  uint64_t u = 0;
  double d = 0;
  std::string s;
  std::vector<Doc> items;                           // kArray
  std::vector<std::pair<std::string, Doc>> fields;  // kObject, in field order

  static Doc Null() { return Doc{}; }
  static Doc Bool(bool v);
  static Doc Int(int64_t v);
  static Doc Uint(uint64_t v);
  static Doc Double(double v);
  static Doc String(std::string v);
  static Doc Array();
  static Doc Object();
  // The field's value, or nullptr.
  const Doc* Find(const std::string& key) const;
  Doc& Add(std::string key, Doc value);  // kObject
};

// Called by FromProto with each message and its finished Doc (nested messages first).
using DocAdjust = std::function<void(const google::protobuf::Message&, Doc*)>;

// Every field of the message, including unset ones (proto3 defaults), by proto field name.
// float and double NaN or infinity become the strings "NaN", "Infinity", "-Infinity" in JSON (as
// protobuf's JSON mapping writes them) and .nan, .inf, -.inf in YAML. Enums print as the table
// and the job spec name them: lower case, without their type's prefix (`succeeded`,
// `fp8_e4m3`, `lowrank`; 0 is `unspecified`). A time field (int64 `unix_ms` or `*_unix_ms`,
// Unix milliseconds on the wire) prints as `time` or `*_time`, an RFC 3339 UTC string with
// milliseconds (`2026-12-03T12:49:36.123Z`), or null when 0 (never set).
Doc FromProto(const google::protobuf::Message& m, const DocAdjust& adjust = nullptr);
// The pieces of that mapping, for tests and for code that builds a Doc by hand.
bool IsTimeField(const google::protobuf::FieldDescriptor* f);
std::string TimeFieldName(const std::string& proto_name);  // created_unix_ms -> created_time
std::string Rfc3339(int64_t unix_ms);                      // 0 -> 1970-01-01T00:00:00.000Z

// Two-space indented JSON ending in a newline; integers of every width are JSON numbers.
std::string DocToJson(const Doc& d);
// Block YAML ending in a newline. Strings a YAML 1.1 or 1.2 reader would take for another type
// (bool, null, a number, a date) or that need escaping are double-quoted.
std::string DocToYaml(const Doc& d);
// Whether a string must be quoted in YAML to read back as the same string.
bool YamlNeedsQuotes(const std::string& s);

// kubectl-style JSONPath template. Supported: literal text, and inside {...}: a path from the root
// (`.a.b`, `$.a`, `.items[0]`, `.items[-1]`, `.items[*].name`, `.a.*`), or a quoted literal
// ({"\n"}, {"\t"}). Several results of one expression are joined by a space; strings print raw,
// numbers and bools as in JSON, objects and arrays as compact JSON. Unsupported syntax (filters
// `?()`, `..`, `range`, slices) and missing fields are errors naming the expression.
absl::StatusOr<std::string> JsonPath(const Doc& d, const std::string& tmpl);
// The template's syntax alone (no document): what -o jsonpath=... checks before any call.
absl::Status CheckJsonPath(const std::string& tmpl);

}  // namespace geofp8::ctl
