// Structured logs of both daemons: one line per event on stderr, logfmt by default
// (`ts=... level=info event=job.submitted job=job-000001 step=40 msg="..."`) or one JSON object
// per line (--log-format json). Field names and events are listed in docs/operations.md.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace geofp8::log {

enum class Format { kText, kJson };  // kText: logfmt
enum class Level { kDebug, kInfo, kWarn, kError };

// "text" or "json"; nullopt for anything else.
std::optional<Format> ParseFormat(std::string_view name);

// Set at start-up, before other threads log: the format, and fields every line carries right
// after `event` (the worker's name, say). Later calls replace both.
void Configure(Format format, std::vector<std::pair<std::string, std::string>> base_fields = {});

// Tests: receive each line (without its newline) instead of stderr; nullptr restores stderr.
void SetSinkForTesting(std::function<void(const std::string& line)> sink);

// One event line, written when the Event is destroyed, i.e. at the end of the statement that
// builds it:
//   log::Info("job.submitted").F("job", id).F("world_size", 2).Msg("accepted");
// Fields keep their order; a key given twice appears twice. Numbers and booleans are JSON
// numbers and booleans in json mode (non-finite doubles are the strings "NaN", "Inf", "-Inf").
class Event {
 public:
  Event(Level level, std::string_view event);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  Event& F(std::string_view key, std::string_view value);
  Event& F(std::string_view key, const std::string& value) {
    return F(key, std::string_view(value));
  }
  Event& F(std::string_view key, const char* value) { return F(key, std::string_view(value)); }
  Event& F(std::string_view key, double value);
  Event& F(std::string_view key, bool value);
  template <typename T,
            std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
  Event& F(std::string_view key, T value) {
    return Number(key, std::to_string(value));
  }
  // The human sentence, written last as `msg`.
  Event& Msg(std::string_view message);

 private:
  struct Field {
    std::string key, value;
    bool number = false;  // a JSON number or boolean: written unquoted in json mode
  };
  Event& Number(std::string_view key, std::string text);

  Level level_;
  std::string event_;
  std::vector<Field> fields_;
  std::optional<std::string> msg_;
};

inline Event Debug(std::string_view event) { return Event(Level::kDebug, event); }
inline Event Info(std::string_view event) { return Event(Level::kInfo, event); }
inline Event Warn(std::string_view event) { return Event(Level::kWarn, event); }
inline Event Error(std::string_view event) { return Event(Level::kError, event); }

}  // namespace geofp8::log
