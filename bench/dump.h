// Reading the gradient dumps `geofp8-train --dump-grads` writes: one folder per step with
// shapes.json and one raw float32 file per layer (the average, and each rank's own gradient).
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "bench/registry.h"

namespace geofp8::bench {

struct DumpedLayer {
  std::string name, avg;
  std::vector<std::string> per_rank;  // file of each rank's local gradient (may be empty)
  int64_t rows = 0, cols = 0;
};

inline std::string ReadFile(const char* prog, const std::string& path, const std::string& field) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) UsageError(prog, field, std::string("cannot open: ") + std::strerror(errno), path);
  std::string out;
  char buf[65536];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, got);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) UsageError(prog, field, "cannot read (a folder?)", path);
  return out;
}

// The value of "key" in one flat JSON object `obj`: a string or an integer, as text.
inline std::string JsonField(const char* prog, const std::string& obj, const std::string& key,
                             const std::string& where) {
  const std::string quoted = "\"" + key + "\"";
  size_t pos = obj.find(quoted);
  if (pos == std::string::npos) UsageError(prog, where, "layer entry has no \"" + key + "\"", obj);
  pos = obj.find(':', pos + quoted.size());
  if (pos == std::string::npos) UsageError(prog, where, "malformed entry", obj);
  pos = obj.find_first_not_of(" \t\r\n", pos + 1);
  if (pos == std::string::npos) UsageError(prog, where, "malformed entry", obj);
  if (obj[pos] == '"') {
    const size_t close = obj.find('"', pos + 1);
    if (close == std::string::npos) UsageError(prog, where, "unterminated string", obj);
    return obj.substr(pos + 1, close - pos - 1);
  }
  const size_t stop = obj.find_first_of(",} \t\r\n", pos);
  return obj.substr(pos, stop == std::string::npos ? std::string::npos : stop - pos);
}

// The strings of the array "key": [...] in `obj` (empty if the key is absent).
inline std::vector<std::string> JsonStrings(const char* prog, const std::string& obj,
                                            const std::string& key, const std::string& where) {
  std::vector<std::string> out;
  const size_t at = obj.find("\"" + key + "\"");
  if (at == std::string::npos) return out;
  const size_t open = obj.find('[', at), close = obj.find(']', at);
  if (open == std::string::npos || close == std::string::npos || close < open) {
    UsageError(prog, where, "malformed \"" + key + "\" list", obj);
  }
  for (size_t p = obj.find('"', open); p != std::string::npos && p < close;) {
    const size_t q = obj.find('"', p + 1);
    if (q == std::string::npos || q > close) UsageError(prog, where, "unterminated string", obj);
    out.push_back(obj.substr(p + 1, q - p - 1));
    p = obj.find('"', q + 1);
  }
  return out;
}

// Reads DIR/shapes.json as geofp8-train writes it: {"layers": [{"name", "rows", "cols", "avg",
// "per_rank"}, ...]}. Only the flat per-layer objects are read.
inline std::vector<DumpedLayer> ReadDump(const char* prog, const std::string& dir,
                                         const std::string& flag) {
  const std::string path = dir + "/shapes.json";
  const std::string text = ReadFile(prog, path, flag);
  const size_t layers = text.find("\"layers\"");
  if (layers == std::string::npos) UsageError(prog, flag, "no \"layers\" in shapes.json", path);
  std::vector<DumpedLayer> out;
  for (size_t pos = text.find('{', layers); pos != std::string::npos; pos = text.find('{', pos)) {
    const size_t close = text.find('}', pos);
    if (close == std::string::npos) {
      UsageError(prog, flag, "unterminated layer entry in shapes.json", path);
    }
    const std::string obj = text.substr(pos, close - pos + 1);
    DumpedLayer l;
    l.name = JsonField(prog, obj, "name", flag);
    l.avg = JsonField(prog, obj, "avg", flag);
    l.per_rank = JsonStrings(prog, obj, "per_rank", flag);
    const std::string rows = JsonField(prog, obj, "rows", flag);
    const std::string cols = JsonField(prog, obj, "cols", flag);
    char* end = nullptr;
    l.rows = std::strtoll(rows.c_str(), &end, 10);
    if (*end || l.rows < 1) {
      UsageError(prog, flag, "layer " + l.name + ": rows must be a positive integer", rows);
    }
    l.cols = std::strtoll(cols.c_str(), &end, 10);
    if (*end || l.cols < 1) {
      UsageError(prog, flag, "layer " + l.name + ": cols must be a positive integer", cols);
    }
    out.push_back(l);
    pos = close + 1;
  }
  if (out.empty()) UsageError(prog, flag, "shapes.json lists no layers", path);
  return out;
}

// One layer's rows x cols float32 file DIR/FILE; every value finite.
inline std::vector<float> ReadMatrix(const char* prog, const std::string& dir,
                                     const std::string& layer, const std::string& file,
                                     int64_t rows, int64_t cols, const std::string& flag) {
  const std::string path = dir + "/" + file;
  const std::string bytes = ReadFile(prog, path, flag);
  const size_t want = static_cast<size_t>(rows * cols) * sizeof(float);
  if (bytes.size() != want) {
    UsageError(prog, flag,
               "layer " + layer + ": file holds " + std::to_string(bytes.size()) +
                   " bytes, shape " + std::to_string(rows) + "x" + std::to_string(cols) +
                   " needs " + std::to_string(want),
               path);
  }
  std::vector<float> g(static_cast<size_t>(rows * cols));
  std::memcpy(g.data(), bytes.data(), want);
  for (float v : g) {
    if (!std::isfinite(v))
      UsageError(prog, flag, "layer " + layer + ": holds a non-finite value", path);
  }
  return g;
}

}  // namespace geofp8::bench
