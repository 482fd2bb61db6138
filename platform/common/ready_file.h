// A daemon's ready file (--ready-file): written once it serves, so that scripts, tests and
// orchestration find its ports without parsing logs. One line of JSON, written atomically
// (temporary file in the same folder, then rename), so a reader sees all of it or nothing.
#pragma once

#include <unistd.h>

#include <cstdio>
#include <string>

namespace geofp8 {

// `s` as a JSON string literal, quotes included.
inline std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (const unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += char(c);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += char(c);
    }
  }
  return out + "\"";
}

// Writes `json` plus a newline to `path`. "" on success, else the problem (naming the path).
inline std::string WriteReadyFile(const std::string& path, const std::string& json) {
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  FILE* f = std::fopen(tmp.c_str(), "w");
  if (!f) return "--ready-file: cannot write " + tmp;
  const bool wrote = std::fputs((json + "\n").c_str(), f) >= 0;
  const bool closed = std::fclose(f) == 0;
  if (!wrote || !closed || std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return "--ready-file: cannot write " + path;
  }
  return "";
}

}  // namespace geofp8
