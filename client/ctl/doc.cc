// Doc: proto -> tree -> JSON / YAML / JSONPath. See doc.h.
#include "client/ctl/doc.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <regex>

#include "absl/status/status.h"
#include "google/protobuf/descriptor.h"
#include "platform/common/status.h"

namespace geofp8::ctl {

Doc Doc::Bool(bool v) {
  Doc d;
  d.kind = Kind::kBool;
  d.b = v;
  return d;
}
Doc Doc::Int(int64_t v) {
  Doc d;
  d.kind = Kind::kInt;
  d.i = v;
  return d;
}
Doc Doc::Uint(uint64_t v) {
  Doc d;
  d.kind = Kind::kUint;
  d.u = v;
  return d;
}
Doc Doc::Double(double v) {
  Doc d;
  d.kind = Kind::kDouble;
  d.d = v;
  return d;
}
Doc Doc::String(std::string v) {
  Doc d;
  d.kind = Kind::kString;
  d.s = std::move(v);
  return d;
}
Doc Doc::Array() {
  Doc d;
  d.kind = Kind::kArray;
  return d;
}
Doc Doc::Object() {
  Doc d;
  d.kind = Kind::kObject;
  return d;
}
const Doc* Doc::Find(const std::string& key) const {
  for (const auto& [k, v] : fields) {
    if (k == key) return &v;
  }
  return nullptr;
}
Doc& Doc::Add(std::string key, Doc value) {
  fields.emplace_back(std::move(key), std::move(value));
  return fields.back().second;
}

namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;

constexpr char kBase64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string Base64(const std::string& in) {
  std::string out;
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    const uint32_t v = uint32_t(uint8_t(in[i])) << 16 | uint32_t(uint8_t(in[i + 1])) << 8 |
                       uint32_t(uint8_t(in[i + 2]));
    for (int s = 18; s >= 0; s -= 6) out += kBase64[(v >> s) & 63];
  }
  if (i < in.size()) {
    uint32_t v = uint32_t(uint8_t(in[i])) << 16;
    if (i + 1 < in.size()) v |= uint32_t(uint8_t(in[i + 1])) << 8;
    out += kBase64[(v >> 18) & 63];
    out += kBase64[(v >> 12) & 63];
    out += i + 1 < in.size() ? kBase64[(v >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

// An enum value as the table and the job spec name it: lower case, without the prefix every
// value of its type shares (JOB_SUCCEEDED -> succeeded, FORMAT_FP8_E4M3 -> fp8_e4m3); the zero
// value (*_UNSPECIFIED) is "unspecified".
std::string EnumName(const google::protobuf::EnumValueDescriptor* e) {
  if (e->number() == 0) return "unspecified";
  const google::protobuf::EnumDescriptor* type = e->type();
  // The longest prefix, ending in '_', that every nonzero value's name starts with; with one
  // nonzero value, that of the zero value (FOO_UNSPECIFIED: FOO_).
  std::string prefix;
  int nonzero = 0;
  for (int i = 0; i < type->value_count(); ++i) {
    if (type->value(i)->number() == 0) continue;
    const std::string& n = type->value(i)->name();
    if (nonzero++ == 0) {
      prefix = n.substr(0, n.rfind('_') + 1);  // npos + 1 == 0: no prefix
      continue;
    }
    while (!prefix.empty() && n.rfind(prefix, 0) != 0) {
      prefix.pop_back();
      const size_t u = prefix.rfind('_');
      prefix.resize(u == std::string::npos ? 0 : u + 1);
    }
  }
  if (nonzero == 1) {
    const google::protobuf::EnumValueDescriptor* zero = type->FindValueByNumber(0);
    const std::string z = zero ? zero->name() : "";
    const size_t u = z.rfind('_');
    const std::string zp = u == std::string::npos ? "" : z.substr(0, u + 1);
    prefix = e->name().rfind(zp, 0) == 0 ? zp : "";
  }
  std::string out = e->name().substr(e->name().rfind(prefix, 0) == 0 ? prefix.size() : 0);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

bool IsTimeField(const FieldDescriptor* f) {
  const std::string& n = f->name();
  return f->cpp_type() == FieldDescriptor::CPPTYPE_INT64 && !f->is_repeated() &&
         (n == "unix_ms" || (n.size() > 8 && n.compare(n.size() - 8, 8, "_unix_ms") == 0));
}

std::string TimeFieldName(const std::string& name) {
  return name.substr(0, name.size() - 7) + "time";  // created_unix_ms -> created_time
}

std::string Rfc3339(int64_t unix_ms) {
  const int64_t secs = unix_ms >= 0 ? unix_ms / 1000 : (unix_ms - 999) / 1000;
  const int ms = static_cast<int>(unix_ms - secs * 1000);
  const time_t t = static_cast<time_t>(secs);
  struct tm tm {};
  gmtime_r(&t, &tm);
  char buf[40];
  std::snprintf(buf, sizeof buf, "%04d-%02d-%02dT%02d:%02d:%02d.%03dZ", tm.tm_year + 1900,
                tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ms);
  return buf;
}

namespace {

Doc Scalar(const Message& m, const Reflection* r, const FieldDescriptor* f, int index,
           const DocAdjust& adjust) {
  const bool rep = f->is_repeated();
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return Doc::Int(rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f));
    case FieldDescriptor::CPPTYPE_INT64:
      return Doc::Int(rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f));
    case FieldDescriptor::CPPTYPE_UINT32:
      return Doc::Uint(rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f));
    case FieldDescriptor::CPPTYPE_UINT64:
      return Doc::Uint(rep ? r->GetRepeatedUInt64(m, f, index) : r->GetUInt64(m, f));
    case FieldDescriptor::CPPTYPE_FLOAT: {
      // Through the float's shortest decimal, so 0.1f prints 0.1 and not 0.10000000149011612.
      const float v = rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f);
      char buf[32];
      auto res = std::to_chars(buf, buf + sizeof buf, v);
      return Doc::Double(std::isfinite(v) ? std::strtod(std::string(buf, res.ptr).c_str(), nullptr)
                                          : static_cast<double>(v));
    }
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return Doc::Double(rep ? r->GetRepeatedDouble(m, f, index) : r->GetDouble(m, f));
    case FieldDescriptor::CPPTYPE_BOOL:
      return Doc::Bool(rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f));
    case FieldDescriptor::CPPTYPE_ENUM: {
      const auto* e = rep ? r->GetRepeatedEnum(m, f, index) : r->GetEnum(m, f);
      return Doc::String(e ? EnumName(e) : "");
    }
    case FieldDescriptor::CPPTYPE_STRING: {
      std::string v = rep ? r->GetRepeatedString(m, f, index) : r->GetString(m, f);
      return Doc::String(f->type() == FieldDescriptor::TYPE_BYTES ? Base64(v) : std::move(v));
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return FromProto(rep ? r->GetRepeatedMessage(m, f, index) : r->GetMessage(m, f), adjust);
  }
  return Doc::Null();
}

std::string Number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "Infinity" : "-Infinity";
  char buf[32];
  auto res = std::to_chars(buf, buf + sizeof buf, v);  // shortest round-trip form
  std::string s(buf, res.ptr);
  return s;
}

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  return out + "\"";
}

// JSON text of a scalar; NaN and infinities as strings, as protobuf's JSON mapping does.
std::string JsonScalar(const Doc& d) {
  switch (d.kind) {
    case Doc::Kind::kNull:
      return "null";
    case Doc::Kind::kBool:
      return d.b ? "true" : "false";
    case Doc::Kind::kInt:
      return std::to_string(d.i);
    case Doc::Kind::kUint:
      return std::to_string(d.u);
    case Doc::Kind::kDouble:
      return std::isfinite(d.d) ? Number(d.d) : "\"" + Number(d.d) + "\"";
    case Doc::Kind::kString:
      return JsonString(d.s);
    default:
      return "";
  }
}

void Json(const Doc& d, int indent, bool pretty, std::string* out) {
  const std::string pad = pretty ? std::string(indent + 2, ' ') : "";
  const std::string end = pretty ? std::string(indent, ' ') : "";
  const char* nl = pretty ? "\n" : "";
  if (d.kind == Doc::Kind::kArray) {
    if (d.items.empty()) {
      *out += "[]";
      return;
    }
    *out += std::string("[") + nl;
    for (size_t i = 0; i < d.items.size(); ++i) {
      *out += pad;
      Json(d.items[i], indent + 2, pretty, out);
      *out += (i + 1 < d.items.size() ? "," : "") + std::string(nl);
    }
    *out += end + "]";
  } else if (d.kind == Doc::Kind::kObject) {
    if (d.fields.empty()) {
      *out += "{}";
      return;
    }
    *out += std::string("{") + nl;
    for (size_t i = 0; i < d.fields.size(); ++i) {
      *out += pad + JsonString(d.fields[i].first) + (pretty ? ": " : ":");
      Json(d.fields[i].second, indent + 2, pretty, out);
      *out += (i + 1 < d.fields.size() ? "," : "") + std::string(nl);
    }
    *out += end + "}";
  } else {
    *out += JsonScalar(d);
  }
}

std::string YamlScalar(const Doc& d) {
  switch (d.kind) {
    case Doc::Kind::kNull:
      return "null";
    case Doc::Kind::kBool:
      return d.b ? "true" : "false";
    case Doc::Kind::kInt:
      return std::to_string(d.i);
    case Doc::Kind::kUint:
      return std::to_string(d.u);
    case Doc::Kind::kDouble: {
      if (std::isnan(d.d)) return ".nan";
      if (std::isinf(d.d)) return d.d > 0 ? ".inf" : "-.inf";
      std::string s = Number(d.d);
      // YAML 1.1 readers (PyYAML) need a dot or exponent to see a float: 1e-05 is a string there.
      if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
      if (s.find('e') != std::string::npos && s.find('.') == std::string::npos) {
        s.insert(s.find('e'), ".0");
      }
      return s;
    }
    case Doc::Kind::kString:
      return YamlNeedsQuotes(d.s) ? JsonString(d.s) : d.s;
    default:
      return "";
  }
}

bool Empty(const Doc& d) {
  return (d.kind == Doc::Kind::kArray && d.items.empty()) ||
         (d.kind == Doc::Kind::kObject && d.fields.empty());
}
bool Compound(const Doc& d) { return d.kind == Doc::Kind::kArray || d.kind == Doc::Kind::kObject; }

void Yaml(const Doc& d, int indent, std::string* out);

// A value after "key:" or "- ": inline when scalar or empty, else on the next lines.
void YamlValue(const Doc& v, int indent, std::string* out) {
  if (!Compound(v)) {
    *out += " " + YamlScalar(v) + "\n";
  } else if (Empty(v)) {
    *out += v.kind == Doc::Kind::kArray ? " []\n" : " {}\n";
  } else {
    *out += "\n";
    Yaml(v, indent, out);
  }
}

void Yaml(const Doc& d, int indent, std::string* out) {
  const std::string pad(indent, ' ');
  if (d.kind == Doc::Kind::kObject) {
    for (const auto& [k, v] : d.fields) {
      *out += pad + (YamlNeedsQuotes(k) ? JsonString(k) : k) + ":";
      // A sequence under a key is indented by two more, as kubectl does.
      YamlValue(v, indent + 2, out);
    }
  } else if (d.kind == Doc::Kind::kArray) {
    for (const auto& item : d.items) {
      if (item.kind == Doc::Kind::kObject && !item.fields.empty()) {
        // "- first: x" then the other keys aligned under "first".
        std::string sub;
        Yaml(item, indent + 2, &sub);
        *out += pad + "- " + sub.substr(indent + 2);
      } else if (item.kind == Doc::Kind::kArray && !item.items.empty()) {
        *out += pad + "-\n";
        Yaml(item, indent + 2, out);
      } else {
        *out += pad + "-";
        YamlValue(item, indent + 2, out);
      }
    }
  } else {
    *out += pad + YamlScalar(d) + "\n";
  }
}

}  // namespace

Doc FromProto(const Message& m, const DocAdjust& adjust) {
  Doc d = Doc::Object();
  const auto* desc = m.GetDescriptor();
  const Reflection* r = m.GetReflection();
  for (int i = 0; i < desc->field_count(); ++i) {
    const FieldDescriptor* f = desc->field(i);
    if (f->is_map()) {
      // Maps print as objects keyed by the entry's key text.
      Doc obj = Doc::Object();
      for (int k = 0; k < r->FieldSize(m, f); ++k) {
        const Message& entry = r->GetRepeatedMessage(m, f, k);
        Doc key = Scalar(entry, entry.GetReflection(), entry.GetDescriptor()->field(0), -1, adjust);
        Doc val = Scalar(entry, entry.GetReflection(), entry.GetDescriptor()->field(1), -1, adjust);
        obj.Add(key.kind == Doc::Kind::kString ? key.s : JsonScalar(key), std::move(val));
      }
      d.Add(f->name(), std::move(obj));
    } else if (f->is_repeated()) {
      Doc arr = Doc::Array();
      for (int k = 0; k < r->FieldSize(m, f); ++k) {
        arr.items.push_back(Scalar(m, r, f, k, adjust));
      }
      d.Add(f->name(), std::move(arr));
    } else if (f->has_presence() && !r->HasField(m, f)) {
      // An absent sub-message, as protobuf's printer says null; likewise an unset `optional`
      // scalar (Policy.taken_step: not taken yet, which is not "taken at step 0").
      d.Add(f->name(), Doc::Null());
    } else if (IsTimeField(f)) {
      // A point in time as RFC 3339 UTC; 0 (never set) is null.
      const int64_t ms = r->GetInt64(m, f);
      d.Add(TimeFieldName(f->name()), ms == 0 ? Doc::Null() : Doc::String(Rfc3339(ms)));
    } else {
      d.Add(f->name(), Scalar(m, r, f, -1, adjust));
    }
  }
  if (adjust) adjust(m, &d);
  return d;
}

std::string DocToJson(const Doc& d) {
  std::string out;
  Json(d, 0, true, &out);
  return out + "\n";
}

std::string DocToYaml(const Doc& d) {
  if (!Compound(d) || Empty(d)) return YamlScalar(d) + "\n";
  std::string out;
  Yaml(d, 0, &out);
  return out;
}

bool YamlNeedsQuotes(const std::string& s) {
  if (s.empty()) return true;
  // Words YAML 1.1 (PyYAML, yaml-cpp) or 1.2 read as bool or null, in any case.
  static const std::regex kWords("^(y|n|yes|no|true|false|on|off|null|~|\\.nan|[-+]?\\.inf|<<|=)$",
                                 std::regex::icase);
  if (std::regex_match(s, kWords)) return true;
  // Anything that starts like a number or a date (1.5, -3, .5, 0x1, 0o7, 1e3, 2026-12-01, 1:30).
  const unsigned char c0 = static_cast<unsigned char>(s[0]);
  if (std::isdigit(c0)) return true;
  if ((s[0] == '-' || s[0] == '+' || s[0] == '.') && s.size() > 1 &&
      (std::isdigit(static_cast<unsigned char>(s[1])) || s[1] == '.')) {
    return true;
  }
  // Indicators that may not start a plain scalar.
  if (std::string("-?:,[]{}#&*!|>'\"%@`").find(s[0]) != std::string::npos) return true;
  if (s.front() == ' ' || s.back() == ' ' || s.back() == ':') return true;
  if (s.find(": ") != std::string::npos || s.find(" #") != std::string::npos) return true;
  for (unsigned char c : s) {
    if (c < 0x20 || c == 0x7f) return true;  // newlines, tabs, control characters
  }
  return false;
}

// ------------------------------------------------------------------------------------ JSONPath

namespace {

absl::Status PathError(const std::string& expr, const std::string& what) {
  return absl::InvalidArgumentError("jsonpath {" + expr + "}: " + what);
}

std::string Printed(const Doc& d) {
  if (d.kind == Doc::Kind::kString) return d.s;
  if (d.kind == Doc::Kind::kDouble) return Number(d.d);
  if (Compound(d)) {
    std::string out;
    Json(d, 0, false, &out);
    return out;
  }
  return JsonScalar(d);
}

struct Segment {
  enum Kind { kField, kStar, kIndex, kAll } kind;
  std::string name;  // kField
  long long index = 0;
};

// The path of one {...} expression, checked without a document.
absl::StatusOr<std::vector<Segment>> ParsePath(const std::string& expr, bool* whole) {
  std::string p = expr;
  while (!p.empty() && p.front() == ' ') p.erase(0, 1);
  while (!p.empty() && p.back() == ' ') p.pop_back();
  *whole = false;
  if (p.rfind("range", 0) == 0 || p == "end") {
    return PathError(expr, "range/end is not supported; use .list[*].field");
  }
  if (!p.empty() && p[0] == '$') p.erase(0, 1);
  if (p.empty() || p == ".") {
    *whole = true;  // {$} or {.}: the whole document
    return std::vector<Segment>{};
  }
  if (p[0] != '.' && p[0] != '[') {
    return PathError(expr, "a path starts with '.' or '$' (e.g. {.progress.step})");
  }
  if (p.find("..") != std::string::npos) {
    return PathError(expr, "recursive descent '..' is not supported");
  }
  std::vector<Segment> out;
  size_t i = 0;
  while (i < p.size()) {
    if (p[i] == '.') {
      ++i;
      size_t j = i;
      while (j < p.size() && p[j] != '.' && p[j] != '[') ++j;
      const std::string name = p.substr(i, j - i);
      if (name.empty()) return PathError(expr, "empty field name at offset " + std::to_string(i));
      if (name.find_first_of("?()@=<>!'\" ") != std::string::npos) {
        return PathError(expr, "unsupported field name '" + name + "'");
      }
      out.push_back(name == "*" ? Segment{Segment::kStar, "", 0}
                                : Segment{Segment::kField, name, 0});
      i = j;
    } else if (p[i] == '[') {
      const size_t close = p.find(']', i);
      if (close == std::string::npos) return PathError(expr, "unclosed '['");
      const std::string idx = p.substr(i + 1, close - i - 1);
      static const std::regex kIndex("^-?[0-9]{1,9}$");
      if (idx == "*") {
        out.push_back(Segment{Segment::kAll, "", 0});
      } else if (idx.size() >= 2 && (idx.front() == '\'' || idx.front() == '"') &&
                 idx.back() == idx.front()) {
        out.push_back(Segment{Segment::kField, idx.substr(1, idx.size() - 2), 0});
      } else if (std::regex_match(idx, kIndex)) {
        out.push_back(Segment{Segment::kIndex, "", std::stoll(idx)});
      } else {
        return PathError(expr, "[" + idx +
                                   "]: only [N], [-N], [*] and ['name'] are supported (no "
                                   "filters or slices)");
      }
      i = close + 1;
    } else {
      return PathError(expr,
                       std::string("unexpected '") + p[i] + "' at offset " + std::to_string(i));
    }
  }
  return out;
}

absl::StatusOr<std::vector<const Doc*>> Evaluate(const Doc& root, const std::string& expr) {
  bool whole = false;
  GEOFP8_ASSIGN_OR_RETURN(const auto path, ParsePath(expr, &whole));
  std::vector<const Doc*> cur = {&root};
  for (const Segment& seg : path) {
    std::vector<const Doc*> next;
    for (const Doc* d : cur) {
      switch (seg.kind) {
        case Segment::kStar:
          if (d->kind == Doc::Kind::kObject) {
            for (const auto& kv : d->fields) next.push_back(&kv.second);
          } else if (d->kind == Doc::Kind::kArray) {
            for (const auto& item : d->items) next.push_back(&item);
          }
          break;
        case Segment::kField: {
          if (d->kind != Doc::Kind::kObject) {
            return PathError(expr, "." + seg.name + ": not an object");
          }
          const Doc* v = d->Find(seg.name);
          if (!v) {
            std::string known;
            for (const auto& kv : d->fields) known += (known.empty() ? "" : ", ") + kv.first;
            return PathError(expr, "no field '" + seg.name + "' (fields: " + known + ")");
          }
          next.push_back(v);
          break;
        }
        case Segment::kAll:
          if (d->kind != Doc::Kind::kArray) return PathError(expr, "[*]: not a list");
          for (const auto& item : d->items) next.push_back(&item);
          break;
        case Segment::kIndex: {
          const std::string idx = std::to_string(seg.index);
          if (d->kind != Doc::Kind::kArray) return PathError(expr, "[" + idx + "]: not a list");
          const long long size = static_cast<long long>(d->items.size());
          const long long k = seg.index < 0 ? size + seg.index : seg.index;
          if (k < 0 || k >= size) {
            return PathError(
                expr, "[" + idx + "]: index out of range (list of " + std::to_string(size) + ")");
          }
          next.push_back(&d->items[static_cast<size_t>(k)]);
          break;
        }
      }
    }
    cur = std::move(next);
  }
  return cur;
}

std::string Unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 1 < s.size()) {
      const char c = s[++i];
      out += c == 'n' ? '\n' : c == 't' ? '\t' : c == 'r' ? '\r' : c;
    } else {
      out += s[i];
    }
  }
  return out;
}

}  // namespace

namespace {

absl::StatusOr<std::string> Template(const Doc* d, const std::string& tmpl) {
  if (tmpl.empty()) return absl::InvalidArgumentError("jsonpath: empty template");
  std::string out;
  size_t i = 0;
  while (i < tmpl.size()) {
    const size_t open = tmpl.find('{', i);
    const size_t stray = tmpl.find('}', i);
    if (stray != std::string::npos && stray < open) {
      return absl::InvalidArgumentError("jsonpath: '}' without '{' at offset " +
                                        std::to_string(stray));
    }
    if (open == std::string::npos) {
      out += Unescape(tmpl.substr(i));
      break;
    }
    out += Unescape(tmpl.substr(i, open - i));
    const size_t close = tmpl.find('}', open);
    if (close == std::string::npos) {
      return absl::InvalidArgumentError("jsonpath: unclosed '{' at offset " + std::to_string(open));
    }
    const std::string expr = tmpl.substr(open + 1, close - open - 1);
    if (expr.size() >= 2 && (expr.front() == '"' || expr.front() == '\'') &&
        expr.back() == expr.front()) {
      out += Unescape(expr.substr(1, expr.size() - 2));
    } else if (!d) {
      bool whole = false;
      GEOFP8_RETURN_IF_ERROR(ParsePath(expr, &whole));
    } else {
      GEOFP8_ASSIGN_OR_RETURN(const auto found, Evaluate(*d, expr));
      for (size_t k = 0; k < found.size(); ++k) out += (k ? " " : "") + Printed(*found[k]);
    }
    i = close + 1;
  }
  return out;
}

}  // namespace

absl::StatusOr<std::string> JsonPath(const Doc& d, const std::string& tmpl) {
  return Template(&d, tmpl);
}

absl::Status CheckJsonPath(const std::string& tmpl) { return Template(nullptr, tmpl).status(); }

}  // namespace geofp8::ctl
