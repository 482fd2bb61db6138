// The daemons' path flags made absolute at start-up: a daemon hands its paths to programs that
// run elsewhere (a command job's own directory) and may change directory itself, so a path given
// relative to where it started must not be read relative to anywhere else.
#pragma once

#include <filesystem>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace geofp8 {

// Makes each non-empty value absolute against the current directory (lexically normalised; the
// file need not exist yet). Returns "" or the error naming the flag and its value.
inline std::string MakeFlagPathsAbsolute(
    const std::vector<std::pair<const char*, std::string*>>& flags) {
  for (const auto& [flag, value] : flags) {
    if (value->empty()) continue;
    std::error_code ec;
    const std::filesystem::path path = std::filesystem::absolute(*value, ec);
    if (ec) return std::string(flag) + ": cannot resolve " + *value + ": " + ec.message();
    *value = path.lexically_normal().string();
  }
  return "";
}

}  // namespace geofp8
