// YAML -> JobSpec / PolicyPatchSpec with validation of every field. yaml-cpp's Mark gives the
// line of each node, so every error reads "line N: spec.path: problem (value)".
#include "platform/policy/job_spec.h"

#include <fnmatch.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "kernels/geometry/hadamard.h"
#include "kernels/model/model.h"
#include "platform/common/status.h"
#include "yaml-cpp/depthguard.h"
#include "yaml-cpp/yaml.h"

namespace geofp8 {
namespace {

// Debian's abseil has its own string_view, so joins of std::string_view are done here.
template <typename Range>
std::string Join(const Range& items, std::string_view sep) {
  std::string out;
  for (const auto& item : items) {
    if (!out.empty()) out += sep;
    out += item;
  }
  return out;
}

// One vocabulary: the enum names come from the shared core headers (format.h, geometry.h,
// policy.h); this table only pairs each parser with its list of accepted names.
template <typename E>
struct Vocabulary {
  std::optional<E> (*parse)(std::string_view);
  std::string_view (*accepted)();
};
constexpr Vocabulary<Format> kFormats{ParseFormat, AcceptedFormats};
constexpr Vocabulary<Scaling> kScalings{ParseScaling, AcceptedScalings};
constexpr Vocabulary<Rounding> kRoundings{ParseRounding, AcceptedRoundings};
constexpr Vocabulary<GeometryMode> kGeometries{ParseGeometryMode, AcceptedGeometryModes};
constexpr Vocabulary<Algorithm> kAlgorithms{ParseAlgorithm, AcceptedAlgorithms};

using Transform = GeometryTransform;
constexpr Vocabulary<Transform> kTransforms{ParseTransformName, AcceptedTransformNames};
std::string TransformName(GeometryMode g, bool hadamard) {
  if (!hadamard) return std::string(GeometryModeName(g));
  return g == GeometryMode::kNone ? "hadamard" : std::string(GeometryModeName(g)) + "+hadamard";
}
constexpr Vocabulary<GeometryEstimator> kEstimators{ParseGeometryEstimator,
                                                    AcceptedGeometryEstimators};

// A value quoted in an error: long values are cut, so that one huge scalar cannot crowd out the
// other errors (the whole message must fit gRPC's 8 KiB metadata limit).
std::string Clip(const std::string& value) {
  constexpr size_t kMax = 64;
  if (value.size() <= kMax) return value;
  return value.substr(0, kMax) + "... (" + std::to_string(value.size()) + " bytes)";
}

// Collects errors while walking the document, each tagged with a path and a line.
class Reader {
 public:
  std::vector<std::string> errors;

  void Error(const YAML::Node& node, const std::string& path, const std::string& problem) {
    std::ostringstream os;
    if (node.IsDefined() && node.Mark().line >= 0) os << "line " << node.Mark().line + 1 << ": ";
    os << path << ": " << problem;
    errors.push_back(os.str());
  }

  static std::string Show(const YAML::Node& node) {
    if (node.IsScalar()) return Clip(node.Scalar());
    if (node.IsSequence()) return "a list";
    if (node.IsMap()) return "a mapping";
    return "null";
  }

  // A mapping whose keys are all in `allowed`. Returns false (with an error) if not a mapping.
  bool Map(const YAML::Node& node, const std::string& path,
           std::initializer_list<std::string_view> allowed) {
    if (!node.IsMap()) {
      Error(node, path, "expected a mapping (" + Show(node) + ")");
      return false;
    }
    // yaml-cpp keeps every pair of a mapping, but node[key] finds only the first: a repeated
    // key would be silently ignored, so it is an error, like an unknown one.
    std::map<std::string, int> first_line;
    for (const auto& kv : node) {
      const std::string key = kv.first.IsScalar() ? kv.first.Scalar() : "?";
      if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
        Error(kv.first, path + "." + Clip(key),
              "unknown field (accepted: " + Join(allowed, ", ") + ")");
      } else if (auto [it, fresh] = first_line.emplace(key, kv.first.Mark().line + 1); !fresh) {
        Error(kv.first, path + "." + key,
              "duplicate key (first at line " + std::to_string(it->second) + ")");
      }
    }
    return true;
  }

  // Reads map[key] into *out if present; returns the node (undefined if absent).
  template <typename T>
  YAML::Node Get(const YAML::Node& map, const char* key, const std::string& path, T* out,
                 const char* expected) {
    YAML::Node node = map[key];
    if (!node.IsDefined() || node.IsNull()) return YAML::Node(YAML::NodeType::Undefined);
    if (!node.IsScalar()) {
      Error(node, path + "." + key, std::string("expected ") + expected + " (" + Show(node) + ")");
      return YAML::Node(YAML::NodeType::Undefined);
    }
    try {
      *out = node.as<T>();
    } catch (const YAML::Exception&) {
      Error(node, path + "." + key, std::string("expected ") + expected + " (" + Show(node) + ")");
      return YAML::Node(YAML::NodeType::Undefined);
    }
    return node;
  }

  void String(const YAML::Node& map, const char* key, const std::string& path, std::string* out) {
    Get(map, key, path, out, "a string");
  }
  void Bool(const YAML::Node& map, const char* key, const std::string& path, bool* out) {
    Get(map, key, path, out, "true or false");
  }

  template <typename T>
  void Number(const YAML::Node& map, const char* key, const std::string& path, T* out, T lo, T hi) {
    T value{};
    const char* expected = std::is_integral_v<T> ? "a decimal integer" : "a number";
    YAML::Node node = Get(map, key, path, &value, expected);
    if (!node.IsDefined()) return;
    if constexpr (std::is_integral_v<T>) {
      // Decimal digits only: yaml-cpp would also read 0x2 as 2 and 017 as 15.
      const std::string& text = node.Scalar();
      const bool negative = !text.empty() && text[0] == '-';
      const size_t digits = !text.empty() && (text[0] == '+' || negative) ? 1 : 0;
      if (text.size() == digits ||
          text.find_first_not_of("0123456789", digits) != std::string::npos) {
        Error(node, path + "." + key, "expected a decimal integer (" + Show(node) + ")");
        return;
      }
      // In range before the cast, so that nothing wraps; past 2^64 is out of range too.
      errno = 0;
      const unsigned long long magnitude = std::strtoull(text.c_str() + digits, nullptr, 10);
      bool in_range = errno != ERANGE;
      if (!negative) {
        in_range = in_range && hi >= T(0) && magnitude <= static_cast<unsigned long long>(hi);
      } else if constexpr (std::is_signed_v<T>) {
        // -lo as a magnitude: lo + 1 first, so that the lowest long long does not overflow.
        in_range =
            in_range && lo < T(0) &&
            magnitude <= static_cast<unsigned long long>(-(static_cast<long long>(lo) + 1)) + 1;
      } else {
        in_range = in_range && magnitude == 0;
      }
      if (!in_range) {
        std::ostringstream os;
        os << "must be in [" << lo << ", " << hi << "] (" << Show(node) << ")";
        Error(node, path + "." + key, os.str());
        return;
      }
      value =
          negative ? static_cast<T>(-static_cast<long long>(magnitude)) : static_cast<T>(magnitude);
    }
    if constexpr (std::is_floating_point_v<T>) {
      if (!std::isfinite(value)) {
        Error(node, path + "." + key, "must be finite (" + Show(node) + ")");
        return;
      }
    }
    if (value < lo || value > hi) {
      std::ostringstream os;
      os << "must be in [" << lo << ", " << hi << "] (" << Show(node) << ")";
      Error(node, path + "." + key, os.str());
      return;
    }
    *out = value;
  }

  template <typename E>
  void Enum(const YAML::Node& map, const char* key, const std::string& path,
            const Vocabulary<E>& table, E* out) {
    std::string name;
    YAML::Node node = Get(map, key, path, &name, "a name");
    if (!node.IsDefined()) return;
    auto value = table.parse(name);
    if (!value) {
      Error(node, path + "." + key,
            "unknown value (" + Clip(name) + "); accepted: " + std::string(table.accepted()));
      return;
    }
    *out = *value;
  }

  template <typename E>
  void OptionalEnum(const YAML::Node& map, const char* key, const std::string& path,
                    const Vocabulary<E>& table, std::optional<E>* out) {
    if (!map[key].IsDefined() || map[key].IsNull()) return;
    E value{};
    size_t before = errors.size();
    Enum(map, key, path, table, &value);
    if (errors.size() == before) *out = value;
  }
  template <typename T>
  void OptionalNumber(const YAML::Node& map, const char* key, const std::string& path,
                      std::optional<T>* out, T lo, T hi) {
    if (!map[key].IsDefined() || map[key].IsNull()) return;
    T value{};
    size_t before = errors.size();
    Number(map, key, path, &value, lo, hi);
    if (errors.size() == before) *out = value;
  }
};

void ReadLayerPolicy(Reader& r, const YAML::Node& node, const std::string& path, LayerPolicy* out) {
  if (!r.Map(node, path,
             {"format", "scaling", "block", "rounding", "geometry", "rank", "alpha",
              "error_feedback", "hadamard_block"})) {
    return;
  }
  r.Enum(node, "format", path, kFormats, &out->format);
  r.Enum(node, "scaling", path, kScalings, &out->scaling);
  r.Number<uint32_t>(node, "block", path, &out->block, 1, 1u << 20);
  r.Enum(node, "rounding", path, kRoundings, &out->rounding);
  Transform t{out->geometry, out->hadamard};
  r.Enum(node, "geometry", path, kTransforms, &t);
  out->geometry = t.geometry;
  out->hadamard = t.hadamard;
  r.Number<uint32_t>(node, "hadamard_block", path, &out->hadamard_block, 2, kMaxHadamardBlock);
  if (const uint32_t b = out->hadamard_block; b & (b - 1)) {
    r.Error(node["hadamard_block"], path + ".hadamard_block",
            "must be a power of two (" + std::to_string(b) + ")");
  }
  r.Number(node, "rank", path, &out->rank, 1, 4096);
  r.Number(node, "alpha", path, &out->alpha, 0.f, 1.f);
  r.Bool(node, "error_feedback", path, &out->error_feedback);
}

void ReadLayerPatch(Reader& r, const YAML::Node& node, const std::string& path,
                    LayerPatchSpec* out) {
  if (!r.Map(node, path,
             {"match", "format", "scaling", "block", "rounding", "geometry", "rank", "alpha",
              "error_feedback", "refresh_interval", "hadamard_block"})) {
    return;
  }
  YAML::Node match = r.Get(node, "match", path, &out->match, "a layer name or glob");
  if (!node["match"].IsDefined() || node["match"].IsNull()) {
    r.Error(node, path + ".match", "required (a layer name or glob such as layers.*.attn.*)");
  } else if (match.IsDefined() && out->match.empty()) {
    r.Error(match, path + ".match", "must not be empty");
  }
  r.OptionalEnum(node, "format", path, kFormats, &out->format);
  r.OptionalEnum(node, "scaling", path, kScalings, &out->scaling);
  r.OptionalNumber<uint32_t>(node, "block", path, &out->block, 1, 1u << 20);
  r.OptionalEnum(node, "rounding", path, kRoundings, &out->rounding);
  std::optional<Transform> t;
  r.OptionalEnum(node, "geometry", path, kTransforms, &t);
  if (t) {
    out->geometry = t->geometry;
    out->hadamard = t->hadamard;
  }
  r.OptionalNumber<uint32_t>(node, "hadamard_block", path, &out->hadamard_block, 2,
                             kMaxHadamardBlock);
  r.OptionalNumber(node, "rank", path, &out->rank, 1, 4096);
  r.OptionalNumber(node, "alpha", path, &out->alpha, 0.f, 1.f);
  if (node["error_feedback"].IsDefined() && !node["error_feedback"].IsNull()) {
    bool v = false;
    size_t before = r.errors.size();
    r.Bool(node, "error_feedback", path, &v);
    if (r.errors.size() == before) out->error_feedback = v;
  }
  r.OptionalNumber(node, "refresh_interval", path, &out->refresh_interval, 1, 1000000);
}

void ReadPatchList(Reader& r, const YAML::Node& node, const std::string& path,
                   std::vector<LayerPatchSpec>* out) {
  if (!node.IsDefined() || node.IsNull()) return;
  if (!node.IsSequence()) {
    r.Error(node, path, "expected a list of layer patches (" + Reader::Show(node) + ")");
    return;
  }
  for (size_t i = 0; i < node.size(); ++i) {
    LayerPatchSpec patch;
    ReadLayerPatch(r, node[i], path + "[" + std::to_string(i) + "]", &patch);
    out->push_back(std::move(patch));
  }
}

// The sections a job spec shares with a policy file (ParsePolicyFile): `exchange`, `policy` and
// `geometry_refresh` under `root`, with paths `p.exchange...`.
void ReadExchange(Reader& r, const YAML::Node& root, const std::string& p, ExchangeSpec* out) {
  if (YAML::Node n = root["exchange"];
      n.IsDefined() && !n.IsNull() &&
      r.Map(n, p + ".exchange", {"algorithm", "bucket_mb", "timeout_s"})) {
    const std::string q = p + ".exchange";
    r.Enum(n, "algorithm", q, kAlgorithms, &out->algorithm);
    r.Number(n, "bucket_mb", q, &out->bucket_mb, 0.001, 4096.0);
    r.Number(n, "timeout_s", q, &out->timeout_s, 1, 86400);
  }
}

void ReadPolicySection(Reader& r, const YAML::Node& root, const std::string& p, PolicySpec* out) {
  if (YAML::Node n = root["policy"];
      n.IsDefined() && !n.IsNull() && r.Map(n, p + ".policy", {"default", "layers", "margin"})) {
    const std::string q = p + ".policy";
    if (YAML::Node d = n["default"]; d.IsDefined() && !d.IsNull()) {
      ReadLayerPolicy(r, d, q + ".default", &out->defaults);
    }
    ReadPatchList(r, n["layers"], q + ".layers", &out->layers);
    r.Number(n, "margin", q, &out->margin, 1, 1000000);
  }
}

void ReadRefresh(Reader& r, const YAML::Node& root, const std::string& p, RefreshSpec* out) {
  YAML::Node n = root["geometry_refresh"];
  if (!n.IsDefined() || n.IsNull() ||
      !r.Map(n, p + ".geometry_refresh",
             {"estimator", "interval", "stagger", "beta", "width", "probes", "probe_every", "adapt",
              "power_iters", "sigma_ema"})) {
    return;
  }
  const std::string q = p + ".geometry_refresh";
  auto& g = *out;
  r.Enum(n, "estimator", q, kEstimators, &g.estimator);
  if (g.estimator == GeometryEstimator::kInstant) g.interval = kInstantRefreshInterval;
  r.Number(n, "interval", q, &g.interval, 1, 1000000);
  r.Bool(n, "stagger", q, &g.stagger);
  r.Number(n, "beta", q, &g.sketch.beta, 0.0f, 0.999f);
  r.Number(n, "width", q, &g.sketch.width, 1, 256);
  r.Number(n, "probes", q, &g.sketch.probes, 0, 64);
  r.Number(n, "probe_every", q, &g.sketch.probe_every, 1, 1000000);
  r.Number(n, "adapt", q, &g.adapt, 0.0f, 4.0f);
  r.Number(n, "power_iters", q, &g.power_iters, 1, 16);
  r.Number(n, "sigma_ema", q, &g.sigma_ema, 0.0f, 0.999f);
  const bool ema = g.estimator == GeometryEstimator::kFactorEma;
  for (const char* k :
       {"beta", "width", "probes", "probe_every", "adapt", "power_iters", "sigma_ema"}) {
    const bool ema_key = std::string_view(k) != "power_iters" && std::string_view(k) != "sigma_ema";
    if (n[k].IsDefined() && ema_key != ema) {
      r.Error(n[k], q + "." + k,
              std::string("applies to estimator ") + (ema_key ? "ema" : "instant") +
                  " only (estimator " + std::string(GeometryEstimatorName(g.estimator)) + ")");
    }
  }
}

bool ValidName(const std::string& s) {
  if (s.empty() || s.size() > 63) return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-';
  });
}

// All errors in one INVALID_ARGUMENT, cut at kMaxErrorBytes with "... and N more errors": the
// message travels in a gRPC trailer, percent-encoded (up to 3 bytes per byte), and a client
// drops trailers over 8 KiB, which would replace the message with a transport error.
// spec.command: a non-empty list of non-empty strings (the program, then its arguments) within
// the kMaxCommand* bounds. A list of numbers would run too, but an unquoted `yes` or `1e3` is
// easy to mistype, so entries must be scalars and are taken as their text.
void ReadCommand(Reader& r, const YAML::Node& root, const std::string& p,
                 std::vector<std::string>* out) {
  const YAML::Node n = root["command"];
  if (!n.IsDefined()) return;
  const std::string path = p + ".command";
  if (!n.IsSequence()) {
    r.Error(n, path,
            "expected a list of strings, the program then its arguments (" + Reader::Show(n) + ")");
    return;
  }
  if (n.size() == 0) {
    r.Error(n, path, "must not be empty: a program to run (an empty list)");
    return;
  }
  if (n.size() > kMaxCommandArgs) {
    r.Error(n, path,
            "at most " + std::to_string(kMaxCommandArgs) + " entries (" + std::to_string(n.size()) +
                ")");
    return;
  }
  std::vector<std::string> args;
  size_t total = 0;
  bool ok = true;
  for (size_t i = 0; i < n.size(); ++i) {
    const YAML::Node a = n[i];
    const std::string at = path + "[" + std::to_string(i) + "]";
    if (!a.IsScalar()) {
      r.Error(a, at, "expected a string (" + Reader::Show(a) + ")");
      ok = false;
      continue;
    }
    const std::string& v = a.Scalar();
    if (i == 0 && v.empty()) {
      r.Error(a, at, "the program must not be empty (\"\")");
      ok = false;
    } else if (v.find('\0') != std::string::npos) {
      r.Error(a, at, "must not contain a NUL byte (" + Clip(v) + ")");
      ok = false;
    } else if (v.size() > kMaxCommandArgBytes) {
      r.Error(a, at, "at most " + std::to_string(kMaxCommandArgBytes) + " bytes (" + Clip(v) + ")");
      ok = false;
    }
    total += v.size() + 1;
    args.push_back(v);
  }
  if (ok && total > kMaxCommandBytes) {
    r.Error(n, path,
            "at most " + std::to_string(kMaxCommandBytes) + " bytes in all (" +
                std::to_string(total) + ")");
    ok = false;
  }
  if (ok) *out = std::move(args);
}

absl::Status Invalid(const std::vector<std::string>& errors) {
  std::string out;
  size_t shown = 0;
  for (; shown < errors.size(); ++shown) {
    const size_t add = errors[shown].size() + (out.empty() ? 0 : 2);
    if (shown > 0 && out.size() + add > kMaxErrorBytes) break;
    if (!out.empty()) out += "; ";
    out += errors[shown];
  }
  if (shown < errors.size()) {
    out += "; ... and " + std::to_string(errors.size() - shown) + " more errors";
  }
  return absl::InvalidArgumentError(out);
}

// A document's shape, from one pass over its text before the YAML parser builds a node (issue
// #31 item 7: a 1 MB flow list cost half a second and 160 MB of nodes): how deep its flow
// collections nest, and how many entries (lines, and items of flow collections) it has. Quotes
// and comments are skipped as YAML reads them: a quote opens a scalar only where one can start.
// "" when within kMaxSpecFlowDepth and kMaxSpecEntries.
std::string ShapeProblem(std::string_view yaml, const std::string& root) {
  int depth = 0;
  size_t entries = 0, line = 1;
  char quote = 0;  // the open quote, if any
  char prev = '\n';
  for (size_t i = 0; i < yaml.size(); prev = yaml[i++]) {
    const char c = yaml[i];
    if (c == '\n') {
      ++line;
      if (++entries > kMaxSpecEntries) break;
      continue;
    }
    if (quote) {
      if (quote == '"' && c == '\\' && i + 1 < yaml.size()) {
        ++i;  // an escaped character; an escaped newline is still a line
        if (yaml[i] == '\n') ++line;
      } else if (quote == '\'' && c == '\'' && i + 1 < yaml.size() && yaml[i + 1] == '\'') {
        ++i;  // '' is a quote inside single quotes
      } else if (c == quote) {
        quote = 0;
      }
      continue;
    }
    const bool at_start = prev == '\n' || prev == ' ' || prev == '\t' || prev == ':' ||
                          prev == ',' || prev == '[' || prev == '{' || prev == '-';
    if ((c == '"' || c == '\'') && at_start) {
      quote = c;
    } else if (c == '#' && (prev == '\n' || prev == ' ' || prev == '\t')) {
      while (i + 1 < yaml.size() && yaml[i + 1] != '\n') ++i;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxSpecFlowDepth) {
        return "line " + std::to_string(line) + ": " + root +
               ": flow collections ([ and {) nested " + "deeper than " +
               std::to_string(kMaxSpecFlowDepth) + " levels";
      }
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    } else if (c == ',' && depth > 0 && ++entries > kMaxSpecEntries) {
      break;
    }
  }
  if (entries > kMaxSpecEntries) {
    return "line " + std::to_string(line) + ": " + root + ": more than " +
           std::to_string(kMaxSpecEntries) + " entries (lines and flow items) by this line";
  }
  return "";
}

// Parses exactly one YAML document of valid UTF-8; `root` names it in errors ("spec", "patch").
absl::StatusOr<YAML::Node> Load(std::string_view yaml, const std::string& root) {
  if (const size_t bad = InvalidUtf8At(yaml); bad != std::string_view::npos) {
    const size_t line = size_t(std::count(yaml.begin(), yaml.begin() + bad, '\n')) + 1;
    return absl::InvalidArgumentError("line " + std::to_string(line) + ": " + root +
                                      ": invalid UTF-8 at byte " + std::to_string(bad));
  }
  if (std::string problem = ShapeProblem(yaml, root); !problem.empty()) {
    return absl::InvalidArgumentError(problem);
  }
  try {
    std::vector<YAML::Node> docs = YAML::LoadAll(std::string(yaml));
    if (docs.size() > 1) {
      return absl::InvalidArgumentError("line " + std::to_string(docs[1].Mark().line + 1) + ": " +
                                        root + ": a second YAML document (--- starts one); " +
                                        "a " + root + " is one document");
    }
    return docs.empty() ? YAML::Node() : docs[0];
  } catch (const YAML::DeepRecursion& e) {  // block collections ("- - - ...") nested as deep
    return absl::InvalidArgumentError("line " + std::to_string(e.mark.line + 1) + ": " + root +
                                      ": nested deeper than " + std::to_string(e.depth()) +
                                      " levels");
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError("line " + std::to_string(e.mark.line + 1) + ": " + root +
                                      ": malformed YAML: " + e.msg);
  }
}

}  // namespace

std::string DataDirPathProblem(std::string_view path) {
  if (path.empty()) return "must not be empty";
  if (path.find('\0') != std::string_view::npos) return "must not contain NUL";
  const std::filesystem::path p{std::string(path)};
  if (p.is_absolute() || p.has_root_name() || p.has_root_directory()) {
    return "must be relative to the worker's data directory";
  }
  for (const auto& part : p) {
    if (part == "..") return "must stay inside the worker's data directory (no ..)";
  }
  return "";
}

std::optional<std::string> ResolveInDataDir(const std::string& base, std::string_view path) {
  if (!DataDirPathProblem(path).empty()) return std::nullopt;
  const std::filesystem::path root = std::filesystem::path(base).lexically_normal();
  const std::filesystem::path full = (root / std::string(path)).lexically_normal();
  // Without ".." the result cannot leave root; checked again so a change above cannot slip.
  const auto rel = full.lexically_relative(root);
  if (rel.empty() || *rel.begin() == "..") return std::nullopt;
  return full.string();
}

// RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF.
size_t InvalidUtf8At(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t n = 0;
    unsigned lo = 0x80, hi = 0xBF;  // range of the first continuation byte
    if (c < 0x80) {
      ++i;
      continue;
    } else if (c >= 0xC2 && c <= 0xDF) {
      n = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
      n = 2;
      if (c == 0xE0) lo = 0xA0;
      if (c == 0xED) hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      n = 3;
      if (c == 0xF0) lo = 0x90;
      if (c == 0xF4) hi = 0x8F;
    } else {
      return i;
    }
    for (size_t k = 1; k <= n; ++k) {
      if (i + k >= s.size()) return i;
      const auto b = static_cast<unsigned char>(s[i + k]);
      if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xBF)) return i;
    }
    i += n + 1;
  }
  return std::string_view::npos;
}

namespace {

// A command job's user program trains its own model on its own data: the built-in trainer's
// fields would be ignored, which must never happen silently. `program` is command[0].
// `with`: what excludes the trainer's fields, as the errors name it ("command (train.py)",
// "launcher: external").
void RejectTrainerFields(Reader& r, const YAML::Node& root, const std::string& p,
                         const std::string& with, const std::string& kind,
                         TrainingSpec* training) {
  for (const char* field : {"model", "data"}) {
    if (YAML::Node n = root[field]; n.IsDefined()) {
      r.Error(n, p + "." + field,
              "not allowed with " + with +
                  ": the built-in trainer's field; the job's own script trains its own model");
    }
  }
  if (YAML::Node n = root["training"]; n.IsDefined() && n.IsMap()) {
    for (const auto& kv : n) {
      const std::string key = kv.first.IsScalar() ? kv.first.Scalar() : "?";
      if (key != "steps") {
        r.Error(kv.first, p + ".training." + Clip(key),
                "not allowed with " + kind + " (accepted: steps); the built-in trainer's field");
      }
    }
  }
  training->steps = 0;  // unknown unless given: the script decides when it is done
}

// The top-level scalars: name (required), world_size and backend.
void ReadJobScalars(Reader& r, const YAML::Node& root, const std::string& p, JobSpec* spec) {
  YAML::Node name = r.Get(root, "name", p, &spec->name, "a string");
  if (!name.IsDefined()) {
    if (!root["name"].IsDefined() || root["name"].IsNull()) r.Error(root, p + ".name", "required");
  } else if (!ValidName(spec->name)) {
    r.Error(name, p + ".name",
            "must be 1-63 characters of [A-Za-z0-9._-] (" + Clip(spec->name) + ")");
  }
  r.Number(root, "world_size", p, &spec->world_size, 1, 1024);
  YAML::Node backend = r.Get(root, "backend", p, &spec->backend, "a string");
  if (backend.IsDefined() && spec->backend != "gloo" && spec->backend != "nccl") {
    r.Error(backend, p + ".backend",
            "unknown value (" + Clip(spec->backend) + "); accepted: gloo, nccl");
  }
  YAML::Node launcher = r.Get(root, "launcher", p, &spec->launcher, "a string");
  if (launcher.IsDefined() && spec->launcher != "worker" && spec->launcher != "external") {
    r.Error(launcher, p + ".launcher",
            "unknown value (" + Clip(spec->launcher) + "); accepted: worker, external");
  }
}

void ReadModel(Reader& r, const YAML::Node& root, const std::string& p, ModelSpec* out) {
  if (YAML::Node n = root["model"];
      n.IsDefined() && !n.IsNull() && r.Map(n, p + ".model", {"preset"})) {
    YAML::Node preset = r.Get(n, "preset", p + ".model", &out->preset, "a string");
    if (preset.IsDefined() && !model::PresetConfig(out->preset)) {
      r.Error(preset, p + ".model.preset",
              "unknown preset (" + Clip(out->preset) +
                  "); accepted: " + std::string(model::AcceptedPresets()));
    }
  }
}

void ReadData(Reader& r, const YAML::Node& root, const std::string& p, DataSpec* out) {
  if (YAML::Node n = root["data"];
      n.IsDefined() && !n.IsNull() && r.Map(n, p + ".data", {"source", "path", "seed"})) {
    const std::string q = p + ".data";
    YAML::Node source = r.Get(n, "source", q, &out->source, "a string");
    r.String(n, "path", q, &out->path);
    r.Number<uint64_t>(n, "seed", q, &out->seed, 0, std::numeric_limits<uint64_t>::max());
    if (source.IsDefined() && out->source != "synthetic" && out->source != "file") {
      r.Error(source, q + ".source",
              "unknown value (" + Clip(out->source) + "); accepted: synthetic, file");
    }
    if (out->source == "file" && out->path.empty()) {
      r.Error(n, q + ".path", "required when data.source is file");
    } else if (!out->path.empty()) {
      if (std::string problem = DataDirPathProblem(out->path); !problem.empty()) {
        r.Error(n["path"], q + ".path", problem + " (" + Clip(out->path) + ")");
      }
    }
  }
}

// spec.training of a job the built-in trainer runs.
void ReadTraining(Reader& r, const YAML::Node& root, const std::string& p, TrainingSpec* out) {
  if (YAML::Node n = root["training"];
      n.IsDefined() && !n.IsNull() &&
      r.Map(n, p + ".training",
            {"steps", "batch_size", "seq_len", "lr", "weight_decay", "warmup_steps", "optimizer",
             "grad_clip", "seed", "eval_every", "eval_batches"})) {
    const std::string q = p + ".training";
    auto& t = *out;
    r.Number<int64_t>(n, "steps", q, &t.steps, 1, kMaxSteps);
    r.Number(n, "batch_size", q, &t.batch_size, 1, kMaxBatchSize);
    r.Number(n, "seq_len", q, &t.seq_len, 1, kMaxSeqLen);
    r.Number(n, "lr", q, &t.lr, 1e-12, 10.0);
    r.Number(n, "weight_decay", q, &t.weight_decay, 0.0, 10.0);
    r.Number<int64_t>(n, "warmup_steps", q, &t.warmup_steps, 0, kMaxSteps);
    YAML::Node opt = r.Get(n, "optimizer", q, &t.optimizer, "a string");
    // The trainer implements AdamW only; a name it would refuse at run time is refused here.
    if (opt.IsDefined() && t.optimizer != "adamw") {
      r.Error(opt, q + ".optimizer", "unknown value (" + Clip(t.optimizer) + "); accepted: adamw");
    }
    r.Number(n, "grad_clip", q, &t.grad_clip, 0.0, 1e6);
    r.Number<uint64_t>(n, "seed", q, &t.seed, 0, std::numeric_limits<uint64_t>::max());
    r.Number<int64_t>(n, "eval_every", q, &t.eval_every, 0, kMaxSteps);
    r.Number(n, "eval_batches", q, &t.eval_batches, 1, kMaxEvalBatches);
    if (t.warmup_steps >= t.steps && n["warmup_steps"].IsDefined()) {
      r.Error(n["warmup_steps"], q + ".warmup_steps",
              "must be less than training.steps (" + std::to_string(t.warmup_steps) +
                  " >= " + std::to_string(t.steps) + ")");
    }
  }
}

// spec.training of a command job: steps only (RejectTrainerFields reports the other keys).
void ReadCommandTraining(Reader& r, const YAML::Node& root, const std::string& p,
                         TrainingSpec* out) {
  if (YAML::Node n = root["training"]; n.IsDefined() && !n.IsNull()) {
    if (n.IsMap()) {
      r.Number<int64_t>(n, "steps", p + ".training", &out->steps, 1, kMaxSteps);
    } else {
      r.Error(n, p + ".training", "expected a mapping (" + Reader::Show(n) + ")");
    }
  }
}

void ReadAutoPolicy(Reader& r, const YAML::Node& root, const std::string& p, AutoPolicySpec* out) {
  if (YAML::Node n = root["auto_policy"];
      n.IsDefined() && !n.IsNull() &&
      r.Map(n, p + ".auto_policy",
            {"enabled", "probe_every", "min_gain", "off_gain", "max_cost_fraction", "geometry",
             "rank", "min_interval", "max_interval", "drift_low", "drift_high"})) {
    const std::string q = p + ".auto_policy";
    auto& a = *out;
    r.Bool(n, "enabled", q, &a.enabled);
    r.Number(n, "probe_every", q, &a.probe_every, 1, 1000000);
    r.Number(n, "min_gain", q, &a.min_gain, 1.0, 1e9);
    r.Number(n, "off_gain", q, &a.off_gain, 0.0, 1e9);
    r.Number(n, "max_cost_fraction", q, &a.max_cost_fraction, 0.0, 1.0);
    r.Enum(n, "geometry", q, kGeometries, &a.geometry);
    r.Number(n, "rank", q, &a.rank, 1, 4096);
    r.Number(n, "min_interval", q, &a.min_interval, 1, 1000000);
    r.Number(n, "max_interval", q, &a.max_interval, 1, 1000000);
    r.Number(n, "drift_low", q, &a.drift_low, 0.0, 1.0);
    r.Number(n, "drift_high", q, &a.drift_high, 0.0, 1.0);
    if (a.off_gain > a.min_gain) {
      r.Error(n, q + ".off_gain", "must not exceed min_gain (" + std::to_string(a.off_gain) + ")");
    }
    if (a.min_interval > a.max_interval) {
      r.Error(n, q + ".min_interval",
              "must not exceed max_interval (" + std::to_string(a.min_interval) + ")");
    }
    if (a.drift_low > a.drift_high) {
      r.Error(n, q + ".drift_low",
              "must not exceed drift_high (" + std::to_string(a.drift_low) + ")");
    }
    if (a.geometry == GeometryMode::kNone) {
      r.Error(n["geometry"], q + ".geometry", "must be diag or lowrank (none)");
    }
  }
}

void ReadCheckpoint(Reader& r, const YAML::Node& root, const std::string& p, CheckpointSpec* out) {
  if (YAML::Node n = root["checkpoint"];
      n.IsDefined() && !n.IsNull() && r.Map(n, p + ".checkpoint", {"dir", "every"})) {
    r.String(n, "dir", p + ".checkpoint", &out->dir);
    r.Number<int64_t>(n, "every", p + ".checkpoint", &out->every, 0, kMaxSteps);
    if (out->every > 0 && out->dir.empty()) {
      r.Error(n, p + ".checkpoint.dir", "required when checkpoint.every > 0");
    } else if (!out->dir.empty()) {
      if (std::string problem = DataDirPathProblem(out->dir); !problem.empty()) {
        r.Error(n["dir"], p + ".checkpoint.dir", problem + " (" + Clip(out->dir) + ")");
      }
    }
  }
}

void ReadRestarts(Reader& r, const YAML::Node& root, const std::string& p, RestartSpec* out) {
  if (YAML::Node n = root["restarts"];
      n.IsDefined() && !n.IsNull() && r.Map(n, p + ".restarts", {"max_restarts"})) {
    r.Number(n, "max_restarts", p + ".restarts", &out->max_restarts, 0, 1000);
  }
}

// The model keeps every layer's attention probabilities for the backward pass; bound them here,
// before a worker finds out with std::bad_alloc.
void CheckAttentionBytes(Reader& r, const YAML::Node& root, const std::string& p,
                         const JobSpec& spec, const model::ModelConfig& model) {
  const auto& t = spec.training;
  const int64_t seq = std::max<int64_t>(t.seq_len, model.seq);
  const double bytes =
      4.0 * double(t.batch_size) * model.heads * double(seq) * double(seq) * model.layers;
  if (bytes > kMaxAttentionBytes) {
    std::ostringstream os;
    os << "batch_size x heads x seq_len^2 x layers x 4 bytes of attention must be at most "
       << (kMaxAttentionBytes >> 30) << " GiB for " << spec.model.preset << " (batch_size "
       << t.batch_size << ", seq_len " << t.seq_len << ": " << int64_t(bytes / (1 << 30))
       << " GiB)";
    const YAML::Node training = root["training"];
    r.Error(training.IsDefined() ? training : root, p + ".training.batch_size", os.str());
  }
}

// A patch whose glob names no layer of the model is a typo that would do nothing.
void CheckPatchGlobs(Reader& r, const YAML::Node& root, const std::string& p, const JobSpec& spec,
                     const model::ModelConfig& model) {
  const std::vector<model::ParamInfo> layout = model::ParamLayout(model);
  for (size_t i = 0; i < spec.policy.layers.size(); ++i) {
    const std::string& glob = spec.policy.layers[i].match;
    if (glob.empty()) continue;  // reported already
    if (std::string problem = UnmatchedGlobProblem(glob, layout, spec.model.preset);
        !problem.empty()) {
      r.Error(root["policy"]["layers"][i]["match"],
              p + ".policy.layers[" + std::to_string(i) + "].match", problem);
    }
  }
}

// The checks that span sections, once each section has been read.
void CheckAcrossSections(Reader& r, const YAML::Node& root, const std::string& p,
                         const JobSpec& spec, bool command_job) {
  // The engine tunes refresh intervals of the instant estimator only: an ema sketch is fed every
  // `interval` steps and its basis drifts smoothly by construction.
  if (spec.auto_policy.enabled && spec.geometry_refresh.estimator == GeometryEstimator::kInstant &&
      spec.auto_policy.min_interval > spec.geometry_refresh.interval) {
    r.Error(root["auto_policy"], p + ".auto_policy.min_interval",
            "must not exceed geometry_refresh.interval (" +
                std::to_string(spec.auto_policy.min_interval) + ")");
  }
  // A command job's layers are the ones its script reports; nothing to check them against yet.
  if (auto model = command_job ? std::nullopt : model::PresetConfig(spec.model.preset)) {
    CheckAttentionBytes(r, root, p, spec, *model);
    CheckPatchGlobs(r, root, p, spec, *model);
  }
  if (spec.backend == "gloo" && spec.exchange.algorithm == Algorithm::kNative) {
    r.Error(root["exchange"], p + ".exchange.algorithm",
            "native needs backend nccl (backend is gloo)");
  }
}

}  // namespace

absl::StatusOr<JobSpec> ParseJobSpec(std::string_view yaml) {
  if (yaml.size() > kMaxSpecBytes) {
    return absl::InvalidArgumentError("spec: at most " + std::to_string(kMaxSpecBytes) +
                                      " bytes (" + std::to_string(yaml.size()) + ")");
  }
  GEOFP8_ASSIGN_OR_RETURN(const YAML::Node root, Load(yaml, "spec"));
  Reader r;
  JobSpec spec;
  const std::string p = "spec";
  if (!r.Map(root, p,
             {"name", "world_size", "backend", "launcher", "command", "model", "data", "training",
              "exchange", "policy", "auto_policy", "geometry_refresh", "checkpoint", "restarts"})) {
    return Invalid(r.errors);
  }
  ReadCommand(r, root, p, &spec.command);
  ReadJobScalars(r, root, p, &spec);
  const bool external = IsExternal(spec);
  if (external && !spec.command.empty()) {
    r.Error(root["command"], p + ".command",
            "not allowed with launcher: external: your launcher starts the script (" +
                Clip(spec.command[0]) + "); remove command, or the launcher line");
  }
  // An external job runs the user's own script, as a command job does.
  const bool command_job = !spec.command.empty() || external;
  if (command_job) {
    RejectTrainerFields(
        r, root, p,
        external ? std::string("launcher: external") : "command (" + Clip(spec.command[0]) + ")",
        external ? "launcher: external" : "command", &spec.training);
  }
  ReadModel(r, root, p, &spec.model);
  ReadData(r, root, p, &spec.data);
  if (command_job) {
    ReadCommandTraining(r, root, p, &spec.training);
  } else {
    ReadTraining(r, root, p, &spec.training);
  }
  ReadExchange(r, root, p, &spec.exchange);
  ReadPolicySection(r, root, p, &spec.policy);
  ReadAutoPolicy(r, root, p, &spec.auto_policy);
  ReadRefresh(r, root, p, &spec.geometry_refresh);
  ReadCheckpoint(r, root, p, &spec.checkpoint);
  ReadRestarts(r, root, p, &spec.restarts);
  CheckAcrossSections(r, root, p, spec, command_job);
  if (!r.errors.empty()) return Invalid(r.errors);
  return spec;
}

absl::StatusOr<PolicyFileSpec> ParsePolicyFile(std::string_view yaml) {
  GEOFP8_ASSIGN_OR_RETURN(const YAML::Node root, Load(yaml, "spec"));
  Reader r;
  PolicyFileSpec file;
  const std::string p = "spec";
  if (!r.Map(root, p, {"exchange", "policy", "geometry_refresh"})) return Invalid(r.errors);
  ReadExchange(r, root, p, &file.exchange);
  ReadPolicySection(r, root, p, &file.policy);
  ReadRefresh(r, root, p, &file.geometry_refresh);
  if (!r.errors.empty()) return Invalid(r.errors);
  return file;
}

absl::StatusOr<PolicyPatchSpec> ParsePolicyPatch(std::string_view yaml) {
  GEOFP8_ASSIGN_OR_RETURN(const YAML::Node root, Load(yaml, "patch"));
  Reader r;
  PolicyPatchSpec patch;
  if (!r.Map(root, "patch", {"reason", "default", "layers"})) return Invalid(r.errors);
  r.String(root, "reason", "patch", &patch.reason);
  if (YAML::Node d = root["default"]; d.IsDefined() && !d.IsNull()) {
    patch.defaults.emplace();
    ReadLayerPolicy(r, d, "patch.default", &*patch.defaults);
  }
  const bool has_layers = root["layers"].IsDefined() && !root["layers"].IsNull();
  if (!has_layers && !patch.defaults) {
    r.Error(root, "patch.layers", "required (a list of layer patches) unless default is given");
  }
  ReadPatchList(r, root["layers"], "patch.layers", &patch.layers);
  if (r.errors.empty() && has_layers && patch.layers.empty() && !patch.defaults) {
    r.Error(root["layers"], "patch.layers", "must hold at least one layer patch");
  }
  if (!r.errors.empty()) return Invalid(r.errors);
  return patch;
}

namespace {

// Emits the fields of a (partial) layer policy in the schema's order.
void EmitFields(YAML::Emitter& out, std::optional<Format> format, std::optional<Scaling> scaling,
                std::optional<uint32_t> block, std::optional<Rounding> rounding,
                std::optional<GeometryMode> geometry, std::optional<bool> hadamard,
                std::optional<uint32_t> hadamard_block, std::optional<int> rank,
                std::optional<float> alpha, std::optional<bool> error_feedback) {
  if (format) out << YAML::Key << "format" << YAML::Value << std::string(FormatName(*format));
  if (scaling) out << YAML::Key << "scaling" << YAML::Value << std::string(ScalingName(*scaling));
  if (block) out << YAML::Key << "block" << YAML::Value << *block;
  if (rounding) {
    out << YAML::Key << "rounding" << YAML::Value << std::string(RoundingName(*rounding));
  }
  if (geometry) {
    out << YAML::Key << "geometry" << YAML::Value
        << TransformName(*geometry, hadamard.value_or(false));
  }
  if (hadamard_block) out << YAML::Key << "hadamard_block" << YAML::Value << *hadamard_block;
  if (rank) out << YAML::Key << "rank" << YAML::Value << *rank;
  // Shortest text that reads back to the same float.
  if (alpha) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.9g", double(*alpha));
    out << YAML::Key << "alpha" << YAML::Value << std::string(buf);
  }
  if (error_feedback) out << YAML::Key << "error_feedback" << YAML::Value << *error_feedback;
}

}  // namespace

std::string WritePolicyPatch(const PolicyPatchSpec& patch, const std::string& header) {
  YAML::Emitter out;
  out << YAML::BeginMap;
  if (!patch.reason.empty()) out << YAML::Key << "reason" << YAML::Value << patch.reason;
  if (patch.defaults) {
    const LayerPolicy& d = *patch.defaults;
    out << YAML::Key << "default" << YAML::Value << YAML::BeginMap;
    EmitFields(out, d.format, d.scaling, d.block, d.rounding, d.geometry, d.hadamard,
               d.hadamard_block ? std::optional<uint32_t>(d.hadamard_block) : std::nullopt, d.rank,
               d.alpha, d.error_feedback);
    out << YAML::EndMap;
  }
  if (!patch.layers.empty()) {
    out << YAML::Key << "layers" << YAML::Value << YAML::BeginSeq;
    for (const LayerPatchSpec& p : patch.layers) {
      out << YAML::BeginMap << YAML::Key << "match" << YAML::Value << YAML::DoubleQuoted << p.match;
      EmitFields(out, p.format, p.scaling, p.block, p.rounding, p.geometry, p.hadamard,
                 p.hadamard_block, p.rank, p.alpha, p.error_feedback);
      if (p.refresh_interval) {
        out << YAML::Key << "refresh_interval" << YAML::Value << *p.refresh_interval;
      }
      out << YAML::EndMap;
    }
    out << YAML::EndSeq;
  }
  out << YAML::EndMap;
  std::string text;
  std::istringstream lines(header);
  for (std::string line; std::getline(lines, line);) text += "# " + line + "\n";
  return text + out.c_str() + "\n";
}

std::string ValidateLayerPatch(const LayerPatchSpec& patch, const std::string& path) {
  std::vector<std::string> errors;
  if (patch.match.empty()) errors.push_back(path + ".layer: must not be empty");
  if (patch.block && (*patch.block < 1 || *patch.block > (1u << 20)))
    errors.push_back(path + ".block: must be in [1, 1048576] (" + std::to_string(*patch.block) +
                     ")");
  if (patch.rank && (*patch.rank < 1 || *patch.rank > 4096))
    errors.push_back(path + ".rank: must be in [1, 4096] (" + std::to_string(*patch.rank) + ")");
  if (patch.alpha && !(*patch.alpha >= 0.f && *patch.alpha <= 1.f))
    errors.push_back(path + ".alpha: must be in [0, 1] (" + std::to_string(*patch.alpha) + ")");
  if (patch.hadamard_block &&
      (*patch.hadamard_block < 2 || *patch.hadamard_block > uint32_t(kMaxHadamardBlock) ||
       (*patch.hadamard_block & (*patch.hadamard_block - 1)) != 0)) {
    errors.push_back(path + ".hadamard_block: must be a power of two in [2, " +
                     std::to_string(kMaxHadamardBlock) + "] (" +
                     std::to_string(*patch.hadamard_block) + ")");
  }
  if (patch.refresh_interval && (*patch.refresh_interval < 1 || *patch.refresh_interval > 1000000))
    errors.push_back(path + ".refresh_interval: must be in [1, 1000000] (" +
                     std::to_string(*patch.refresh_interval) + ")");
  return Join(errors, "; ");
}

std::optional<Format> ParseFormatName(std::string_view n) { return ParseFormat(n); }
std::optional<Scaling> ParseScalingName(std::string_view n) { return ParseScaling(n); }
std::optional<Rounding> ParseRoundingName(std::string_view n) { return ParseRounding(n); }
std::optional<GeometryMode> ParseGeometryName(std::string_view n) { return ParseGeometryMode(n); }
std::optional<Algorithm> ParseAlgorithmName(std::string_view n) { return ParseAlgorithm(n); }
std::string_view FormatNameOf(Format f) { return FormatName(f); }
std::string_view ScalingNameOf(Scaling s) { return ScalingName(s); }
std::string_view RoundingNameOf(Rounding r) { return RoundingName(r); }
std::string_view GeometryNameOf(GeometryMode g) { return GeometryModeName(g); }
std::string_view AlgorithmNameOf(Algorithm a) { return AlgorithmName(a); }
std::string_view AcceptedFormatNames() { return AcceptedFormats(); }
std::string_view AcceptedScalingNames() { return AcceptedScalings(); }
std::string_view AcceptedRoundingNames() { return AcceptedRoundings(); }
std::string_view AcceptedGeometryNames() { return AcceptedGeometryModes(); }
std::string_view AcceptedAlgorithmNames() { return AcceptedAlgorithms(); }

std::vector<RefreshSchedule> RefreshScheduleOf(const std::vector<int>& intervals, int world_size,
                                               bool stagger) {
  const int64_t n = static_cast<int64_t>(intervals.size());
  const int world = std::max(1, world_size);
  std::vector<RefreshSchedule> out;
  out.reserve(intervals.size());
  for (int64_t i = 0; i < n; ++i) {
    RefreshSchedule s;
    s.interval = std::max(1, intervals[i]);
    s.owner = stagger ? static_cast<int>(i % world) : 0;
    s.offset = stagger ? static_cast<int>((i * s.interval) / n) : 0;
    out.push_back(s);
  }
  return out;
}

std::string_view AcceptedPolicyPresets() {
  return "fp32, bf16, fp8, geofp8, nvfp4, geonvfp4, fp8-ef, nvfp4-ef";
}

std::optional<std::string> PresetPolicyFile(std::string_view name) {
  // 1 MiB buckets, as geofp8-train has always run; the geometry presets use the estimator chosen
  // on training trajectories (docs/benchmarks.md, "Geometry on training trajectories"): a
  // Kronecker-factor EMA fed every step.
  const std::string bucket = "exchange: {algorithm: ALG, bucket_mb: 1}\n";
  auto file = [&](std::string_view alg, std::string_view format, bool geometry,
                  bool feedback = false) {
    std::string s = bucket;
    s.replace(s.find("ALG"), 3, alg);
    s += "policy:\n  default: {format: " + std::string(format) +
         (feedback ? ", error_feedback: true" : "") + "}\n";
    if (geometry) {
      s += "  layers:\n    - {match: \"*\", geometry: lowrank, rank: 8}\n";
      s += "geometry_refresh: {estimator: ema, interval: 1}\n";
    }
    return s;
  };
  if (name == "fp32") return file("fp32", "fp32", false);
  if (name == "bf16") return file("bf16", "bf16", false);
  if (name == "fp8") return file("auto", "fp8_e4m3", false);
  if (name == "geofp8") return file("auto", "fp8_e4m3", true);
  if (name == "nvfp4") return file("auto", "nvfp4", false);
  if (name == "geonvfp4") return file("auto", "nvfp4", true);
  // Error feedback, the arm that removed the floor a non-vanishing per-rank gradient leaves
  // (docs/benchmarks.md, "The damage map"); two_phase, which feedback needs and auto may not pick.
  if (name == "fp8-ef") return file("two_phase", "fp8_e4m3", false, true);
  if (name == "nvfp4-ef") return file("two_phase", "nvfp4", false, true);
  return std::nullopt;
}

std::string UnmatchedGlobProblem(std::string_view glob, const std::vector<model::ParamInfo>& layers,
                                 std::string_view model) {
  for (const auto& l : layers) {
    if (LayerMatches(glob, l.name)) return "";
  }
  // Name the first block's layers and those outside the blocks: enough to see the scheme.
  std::vector<std::string> names;
  bool blocks = false;
  for (const auto& l : layers) {
    if (!l.name.starts_with("layers.")) {
      names.push_back(l.name);
    } else if (l.name.starts_with("layers.0.")) {
      names.push_back(l.name);
      blocks = true;
    }
  }
  return "matches no layer of " + std::string(model) + " (" + Clip(std::string(glob)) +
         "); its layers are " + Join(names, ", ") +
         (blocks ? ", and the same for each block layers.N" : "");
}

bool LayerMatches(std::string_view pattern, std::string_view name) {
  if (pattern == name) return true;
  return fnmatch(std::string(pattern).c_str(), std::string(name).c_str(), 0) == 0;
}

}  // namespace geofp8
