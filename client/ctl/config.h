// geofp8ctl's config file, in the manner of a kubeconfig: named contexts (server, token file,
// TLS files) and the current one. Default path $XDG_CONFIG_HOME/geofp8/config.yaml, else
// ~/.config/geofp8/config.yaml; --config or GEOFP8_CONFIG override it.
//
//   current-context: local
//   contexts:
//     - name: local
//       server: 127.0.0.1:7070
//       token-file: token          # relative paths are relative to the config file's folder
//       ca: ca.crt
//       cert: client.crt
//       key: client.key
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace geofp8::ctl {

struct Context {
  std::string name, server, token_file, ca, cert, key;
};

struct Config {
  std::string path;  // the file it was read from or will be written to
  bool exists = false;
  std::string current_context;
  std::vector<Context> contexts;

  const Context* Find(const std::string& name) const;
  Context* Find(const std::string& name);
};

// The path to use: `flag` if set, else env GEOFP8_CONFIG, else the default.
std::string ConfigPath(const std::string& flag);

// Reads and checks `path`. A missing file is an empty config (exists = false) unless
// `must_exist`. Errors name the file, the line and the field: "PATH:3: contexts[0].server: ...".
absl::StatusOr<Config> LoadConfig(const std::string& path, bool must_exist);
absl::StatusOr<Config> ParseConfig(const std::string& text, const std::string& path);

// Writes the config (mode 0600, atomically through a temporary file), creating the folder.
absl::Status SaveConfig(const Config& c);
std::string ConfigToYaml(const Config& c);

// A context's file path as given, with ~ expanded and a relative path taken relative to the
// config file's folder.
std::string ResolvePath(const std::string& config_path, const std::string& file);

}  // namespace geofp8::ctl
