// Structured event lines (see log.h): logfmt or JSON, one write per line under a mutex so lines
// from different threads never interleave.
#include "platform/common/log.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <mutex>

namespace geofp8::log {
namespace {

struct State {
  std::mutex mu;
  Format format = Format::kText;
  std::vector<std::pair<std::string, std::string>> base;
  std::function<void(const std::string&)> sink;
};

State& Global() {
  static State* state = new State;  // never destroyed: threads may log during exit
  return *state;
}

const char* LevelName(Level level) {
  switch (level) {
    case Level::kDebug:
      return "debug";
    case Level::kInfo:
      return "info";
    case Level::kWarn:
      return "warn";
    case Level::kError:
      return "error";
  }
  return "info";
}

// RFC 3339 UTC with milliseconds: 2026-12-01T17:01:20.123Z.
std::string Timestamp() {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const int ms = int(
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[40];
  const size_t n = std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  std::snprintf(buf + n, sizeof buf - n, ".%03dZ", ms);
  return buf;
}

// Control characters as \n, \t, \r or \u00XX; quote and backslash escaped. The same escapes are
// valid in a JSON string and in a logfmt quoted value.
void AppendEscaped(std::string* out, std::string_view s) {
  for (const unsigned char c : s) {
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\t':
        *out += "\\t";
        break;
      case '\r':
        *out += "\\r";
        break;
      default:
        if (c < 0x20 || c == 0x7f) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          *out += buf;
        } else {
          *out += char(c);
        }
    }
  }
}

// logfmt: bare when the value is non-empty and holds no space, '=', quote or control character.
void AppendLogfmtValue(std::string* out, std::string_view v) {
  bool bare = !v.empty();
  for (const unsigned char c : v) {
    if (c <= ' ' || c == '=' || c == '"' || c == '\\' || c == 0x7f) {
      bare = false;
      break;
    }
  }
  if (bare) {
    *out += v;
    return;
  }
  *out += '"';
  AppendEscaped(out, v);
  *out += '"';
}

void AppendJsonString(std::string* out, std::string_view v) {
  *out += '"';
  AppendEscaped(out, v);
  *out += '"';
}

}  // namespace

std::optional<Format> ParseFormat(std::string_view name) {
  if (name == "text") return Format::kText;
  if (name == "json") return Format::kJson;
  return std::nullopt;
}

void Configure(Format format, std::vector<std::pair<std::string, std::string>> base_fields) {
  State& g = Global();
  std::lock_guard<std::mutex> lock(g.mu);
  g.format = format;
  g.base = std::move(base_fields);
}

void SetSinkForTesting(std::function<void(const std::string& line)> sink) {
  State& g = Global();
  std::lock_guard<std::mutex> lock(g.mu);
  g.sink = std::move(sink);
}

Event::Event(Level level, std::string_view event) : level_(level), event_(event) {}

Event& Event::F(std::string_view key, std::string_view value) {
  fields_.push_back({std::string(key), std::string(value), false});
  return *this;
}

Event& Event::F(std::string_view key, double value) {
  if (!std::isfinite(value)) {
    // JSON has no NaN or infinity: strings, as protobuf's JSON mapping writes them.
    return F(key, std::string_view(std::isnan(value) ? "NaN" : value > 0 ? "Inf" : "-Inf"));
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.6g", value);
  return Number(key, buf);
}

Event& Event::F(std::string_view key, bool value) { return Number(key, value ? "true" : "false"); }

Event& Event::Number(std::string_view key, std::string text) {
  fields_.push_back({std::string(key), std::move(text), true});
  return *this;
}

Event& Event::Msg(std::string_view message) {
  msg_ = std::string(message);
  return *this;
}

Event::~Event() {
  State& g = Global();
  const std::string ts = Timestamp();
  std::lock_guard<std::mutex> lock(g.mu);
  std::string line;
  line.reserve(256);
  if (g.format == Format::kJson) {
    line += "{\"ts\":";
    AppendJsonString(&line, ts);
    line += ",\"level\":";
    AppendJsonString(&line, LevelName(level_));
    line += ",\"event\":";
    AppendJsonString(&line, event_);
    for (const auto& [k, v] : g.base) {
      line += ',';
      AppendJsonString(&line, k);
      line += ':';
      AppendJsonString(&line, v);
    }
    for (const Field& f : fields_) {
      line += ',';
      AppendJsonString(&line, f.key);
      line += ':';
      if (f.number) {
        line += f.value;
      } else {
        AppendJsonString(&line, f.value);
      }
    }
    if (msg_) {
      line += ",\"msg\":";
      AppendJsonString(&line, *msg_);
    }
    line += '}';
  } else {
    line += "ts=" + ts + " level=" + LevelName(level_) + " event=";
    AppendLogfmtValue(&line, event_);
    for (const auto& [k, v] : g.base) {
      line += ' ' + k + '=';
      AppendLogfmtValue(&line, v);
    }
    for (const Field& f : fields_) {
      line += ' ' + f.key + '=';
      AppendLogfmtValue(&line, f.value);
    }
    if (msg_) {
      line += " msg=";
      AppendLogfmtValue(&line, *msg_);
    }
  }
  if (g.sink) {
    g.sink(line);
    return;
  }
  line += '\n';
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace geofp8::log
