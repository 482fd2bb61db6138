// geofp8ctl config file: see config.h.
#include "client/ctl/config.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/status/status.h"
#include "client/ctl/doc.h"
#include "platform/common/status.h"
#include "yaml-cpp/yaml.h"

namespace geofp8::ctl {

const Context* Config::Find(const std::string& name) const {
  for (const auto& c : contexts) {
    if (c.name == name) return &c;
  }
  return nullptr;
}
Context* Config::Find(const std::string& name) {
  for (auto& c : contexts) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

std::string ConfigPath(const std::string& flag) {
  if (!flag.empty()) return flag;
  if (const char* env = std::getenv("GEOFP8_CONFIG"); env && *env) return env;
  if (const char* xdg = std::getenv("XDG_CONFIG_HOME"); xdg && *xdg) {
    return std::string(xdg) + "/geofp8/config.yaml";
  }
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : ".") + "/.config/geofp8/config.yaml";
}

namespace {

absl::Status At(const std::string& path, const YAML::Node& n, const std::string& field,
                const std::string& problem) {
  return absl::InvalidArgumentError(path + ":" + std::to_string(n.Mark().line + 1) + ": " + field +
                                    ": " + problem);
}

absl::StatusOr<std::string> ScalarString(const std::string& path, const YAML::Node& n,
                                         const std::string& field) {
  if (!n.IsScalar()) return At(path, n, field, "must be a string");
  return n.Scalar();
}

}  // namespace

absl::StatusOr<Config> ParseConfig(const std::string& text, const std::string& path) {
  Config c;
  c.path = path;
  c.exists = true;
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(path + ":" + std::to_string(e.mark.line + 1) +
                                      ": not valid YAML: " + e.msg);
  }
  if (root.IsNull()) return c;  // an empty file
  if (!root.IsMap()) return At(path, root, "(top level)", "must be a mapping");
  for (auto kv : root) {
    const std::string key = kv.first.Scalar();
    if (key == "current-context") {
      GEOFP8_ASSIGN_OR_RETURN(c.current_context, ScalarString(path, kv.second, key));
    } else if (key == "contexts") {
      if (kv.second.IsNull()) continue;
      if (!kv.second.IsSequence()) return At(path, kv.second, key, "must be a list of contexts");
      for (size_t i = 0; i < kv.second.size(); ++i) {
        const YAML::Node item = kv.second[i];
        const std::string where = "contexts[" + std::to_string(i) + "]";
        if (!item.IsMap()) return At(path, item, where, "must be a mapping with name and server");
        Context ctx;
        for (auto f : item) {
          const std::string name = f.first.Scalar();
          const std::string field = where + "." + name;
          std::string* dst = name == "name"         ? &ctx.name
                             : name == "server"     ? &ctx.server
                             : name == "token-file" ? &ctx.token_file
                             : name == "ca"         ? &ctx.ca
                             : name == "cert"       ? &ctx.cert
                             : name == "key"        ? &ctx.key
                                                    : nullptr;
          if (!dst) {
            return At(path, f.first, field,
                      "unknown field; accepted: name, server, token-file, ca, cert, key");
          }
          GEOFP8_ASSIGN_OR_RETURN(*dst, ScalarString(path, f.second, field));
        }
        if (ctx.name.empty()) return At(path, item, where + ".name", "required");
        if (c.Find(ctx.name)) {
          return At(path, item, where + ".name", "duplicate context (" + ctx.name + ")");
        }
        if (!ctx.cert.empty() && ctx.key.empty()) {
          return At(path, item, where + ".key", "required with cert");
        }
        c.contexts.push_back(std::move(ctx));
      }
    } else {
      return At(path, kv.first, key, "unknown field; accepted: current-context, contexts");
    }
  }
  if (!c.current_context.empty() && !c.Find(c.current_context)) {
    return At(path, root["current-context"], "current-context",
              "no context named " + c.current_context);
  }
  return c;
}

absl::StatusOr<Config> LoadConfig(const std::string& path, bool must_exist) {
  std::ifstream f(path);
  if (!f) {
    if (errno == ENOENT && !must_exist) {
      Config c;
      c.path = path;
      return c;
    }
    return absl::InvalidArgumentError(path + ": cannot read: " + std::strerror(errno));
  }
  std::ostringstream ss;
  ss << f.rdbuf();
  return ParseConfig(ss.str(), path);
}

std::string ConfigToYaml(const Config& c) {
  Doc root = Doc::Object();
  root.Add("current-context", Doc::String(c.current_context));
  Doc list = Doc::Array();
  for (const auto& ctx : c.contexts) {
    Doc d = Doc::Object();
    d.Add("name", Doc::String(ctx.name));
    d.Add("server", Doc::String(ctx.server));
    if (!ctx.token_file.empty()) d.Add("token-file", Doc::String(ctx.token_file));
    if (!ctx.ca.empty()) d.Add("ca", Doc::String(ctx.ca));
    if (!ctx.cert.empty()) d.Add("cert", Doc::String(ctx.cert));
    if (!ctx.key.empty()) d.Add("key", Doc::String(ctx.key));
    list.items.push_back(std::move(d));
  }
  root.Add("contexts", std::move(list));
  return "# geofp8ctl config (geofp8ctl config --help)\n" + DocToYaml(root);
}

absl::Status SaveConfig(const Config& c) {
  const std::filesystem::path p(c.path);
  std::error_code ec;
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  if (ec) {
    return absl::InvalidArgumentError(c.path + ": cannot create folder: " + ec.message());
  }
  const std::string tmp = c.path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return absl::InvalidArgumentError(c.path + ": cannot write: " + std::strerror(errno));
  const std::string text = ConfigToYaml(c);
  size_t off = 0;
  while (off < text.size()) {
    const ssize_t n = ::write(fd, text.data() + off, text.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return absl::InvalidArgumentError(c.path + ": cannot write: " + std::strerror(err));
    }
    off += size_t(n);
  }
  bool ok = ::fsync(fd) == 0;
  ok = ::close(fd) == 0 && ok;
  if (!ok || ::rename(tmp.c_str(), c.path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return absl::InvalidArgumentError(c.path + ": cannot write: " + std::strerror(err));
  }
  return absl::OkStatus();
}

std::string ResolvePath(const std::string& config_path, const std::string& file) {
  if (file.empty()) return file;
  if (file == "~" || file.rfind("~/", 0) == 0) {
    const char* home = std::getenv("HOME");
    return std::string(home ? home : "") + file.substr(1);
  }
  if (file[0] == '/') return file;
  const std::filesystem::path dir = std::filesystem::path(config_path).parent_path();
  return dir.empty() ? file : (dir / file).string();
}

}  // namespace geofp8::ctl
