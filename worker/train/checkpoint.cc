// Binary checkpoint format (little-endian), version 4:
//   "GFP8CKPT" | u32 version | str fingerprint | i64 next_step | u64 rng_seed |
//   u64 policy_version | f64 best_val_loss | u64 bytes_sent | f32[] weights | f32[] m |
//   f32[] v | u64 layers | per layer: bytes active, bytes pending, u64 pending_from, bytes sketch |
//   u64 ranks | per rank: u64 layers | per layer: u64 geometry_version, f32[] local, f32[] owner |
//   f64 gns_grad_sq | f64 gns_trace | i64 gns_samples | u64 FNV-1a of everything before it.
// Version 3 lacks the error-feedback residuals and the noise scale's averages; version 2 also each
// layer's sketch (the ema estimator's state); version 1 also lacks the three fields after rng_seed.
// str/bytes/f32[] are a u64 count followed by the elements; geometry bytes are kernels/geometry's
// checksummed wire form.

#include "worker/train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>

#include "kernels/common/check.h"

namespace geofp8::train {
namespace {

constexpr char kMagic[8] = {'G', 'F', 'P', '8', 'C', 'K', 'P', 'T'};
constexpr uint32_t kVersion = 4;

uint64_t Fnv(const uint8_t* p, size_t n, uint64_t h = 0xcbf29ce484222325ULL) {
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ULL;
  return h;
}

struct Writer {
  std::string out;
  void Raw(const void* p, size_t n) { out.append(static_cast<const char*>(p), n); }
  template <typename T>
  void Pod(T v) {
    Raw(&v, sizeof v);
  }
  template <typename T>
  void Vec(const std::vector<T>& v) {
    Pod<uint64_t>(v.size());
    Raw(v.data(), v.size() * sizeof(T));
  }
  void Str(const std::string& s) {
    Pod<uint64_t>(s.size());
    Raw(s.data(), s.size());
  }
};

struct Reader {
  std::string_view in;
  const std::string& path;
  size_t pos = 0;
  void Raw(void* p, size_t n) {
    GEOFP8_CHECK(n <= in.size() - pos, "checkpoint ", path, ": truncated at byte ", pos);
    std::memcpy(p, in.data() + pos, n);
    pos += n;
  }
  template <typename T>
  T Pod() {
    T v;
    Raw(&v, sizeof v);
    return v;
  }
  template <typename T>
  std::vector<T> Vec() {
    const uint64_t n = Pod<uint64_t>();
    GEOFP8_CHECK(n <= (in.size() - pos) / sizeof(T), "checkpoint ", path, ": truncated at byte ",
                 pos);
    std::vector<T> v(n);
    Raw(v.data(), n * sizeof(T));
    return v;
  }
  std::string Str() {
    std::vector<char> v = Vec<char>();
    return std::string(v.begin(), v.end());
  }
};

}  // namespace

std::string SerializeCheckpoint(const Checkpoint& c) {
  Writer w;
  w.Raw(kMagic, sizeof kMagic);
  w.Pod(kVersion);
  w.Str(c.fingerprint);
  w.Pod(c.next_step);
  w.Pod(c.rng_seed);
  w.Pod(c.policy_version);
  w.Pod(c.best_val_loss);
  w.Pod(c.bytes_sent);
  w.Vec(c.weights);
  w.Vec(c.m);
  w.Vec(c.v);
  w.Pod<uint64_t>(c.geometry.size());
  for (const auto& g : c.geometry) {
    w.Vec(g.active);
    w.Vec(g.pending);
    w.Pod(g.pending_from);
    w.Vec(g.sketch);
  }
  w.Pod<uint64_t>(c.residuals.size());
  for (const auto& rank : c.residuals) {
    w.Pod<uint64_t>(rank.size());
    for (const LayerResidual& r : rank) {
      w.Pod(r.geometry_version);
      w.Vec(r.local);
      w.Vec(r.owner);
    }
  }
  w.Pod(c.gns_grad_sq);
  w.Pod(c.gns_trace);
  w.Pod(c.gns_samples);
  w.Pod(Fnv(reinterpret_cast<const uint8_t*>(w.out.data()), w.out.size()));
  return std::move(w.out);
}

void SaveCheckpoint(const std::string& path, const Checkpoint& c) {
  const std::string bytes = SerializeCheckpoint(c);
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  GEOFP8_CHECK(fd >= 0, "checkpoint ", tmp, ": cannot create: ", std::strerror(errno));
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int err = errno;
      ::close(fd);
      GEOFP8_FAIL("checkpoint ", tmp, ": write failed: ", std::strerror(err));
    }
    done += size_t(n);
  }
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  GEOFP8_CHECK(synced, "checkpoint ", tmp, ": fsync failed: ", std::strerror(errno));
  GEOFP8_CHECK(std::rename(tmp.c_str(), path.c_str()) == 0, "checkpoint ", path,
               ": rename failed: ", std::strerror(errno));
}

Checkpoint ParseCheckpoint(std::string_view in, const std::string& path) {
  GEOFP8_CHECK(in.size() >= sizeof kMagic + 4 + 8 && std::memcmp(in.data(), kMagic, 8) == 0,
               "checkpoint ", path, ": not a GeoFP8 checkpoint (bad magic)");
  uint64_t stored;
  std::memcpy(&stored, in.data() + in.size() - 8, 8);
  GEOFP8_CHECK(stored == Fnv(reinterpret_cast<const uint8_t*>(in.data()), in.size() - 8),
               "checkpoint ", path, ": hash mismatch (corrupt or truncated)");
  Reader r{in, path};
  r.pos = sizeof kMagic;
  const uint32_t version = r.Pod<uint32_t>();
  GEOFP8_CHECK(version >= 1 && version <= kVersion, "checkpoint ", path, ": format version ",
               version, " is not supported (this build reads 1 to ", kVersion, ")");
  Checkpoint c;
  c.fingerprint = r.Str();
  c.next_step = r.Pod<int64_t>();
  c.rng_seed = r.Pod<uint64_t>();
  if (version >= 2) {
    c.policy_version = r.Pod<uint64_t>();
    c.best_val_loss = r.Pod<double>();
    c.bytes_sent = r.Pod<uint64_t>();
  }
  c.weights = r.Vec<float>();
  c.m = r.Vec<float>();
  c.v = r.Vec<float>();
  const uint64_t layers = r.Pod<uint64_t>();
  GEOFP8_CHECK(layers <= c.weights.size(), "checkpoint ", path, ": bad layer count ", layers);
  c.geometry.resize(layers);
  for (auto& g : c.geometry) {
    g.active = r.Vec<uint8_t>();
    g.pending = r.Vec<uint8_t>();
    g.pending_from = r.Pod<uint64_t>();
    if (version >= 3) g.sketch = r.Vec<uint8_t>();
  }
  if (version >= 4) {
    const uint64_t ranks = r.Pod<uint64_t>();
    GEOFP8_CHECK(ranks <= 1024, "checkpoint ", path, ": bad rank count ", ranks);
    c.residuals.resize(ranks);
    for (auto& rank : c.residuals) {
      const uint64_t n = r.Pod<uint64_t>();
      GEOFP8_CHECK(n <= c.weights.size(), "checkpoint ", path, ": bad residual layer count ", n);
      rank.resize(n);
      for (LayerResidual& res : rank) {
        res.geometry_version = r.Pod<uint64_t>();
        res.local = r.Vec<float>();
        res.owner = r.Vec<float>();
      }
    }
    c.gns_grad_sq = r.Pod<double>();
    c.gns_trace = r.Pod<double>();
    c.gns_samples = r.Pod<int64_t>();
  }
  GEOFP8_CHECK(r.pos == in.size() - 8, "checkpoint ", path, ": trailing bytes");
  if (version == 1) {
    for (size_t l = 0; l < c.geometry.size(); ++l) {
      GEOFP8_CHECK(c.geometry[l].active.empty() && c.geometry[l].pending.empty(), "checkpoint ",
                   path, ": format version 1 holds geometry (layer ", l,
                   ") but not its pending refreshes, so a resume could not continue exactly; "
                   "restart the run from step 0");
    }
    c.geometry.clear();
  }
  return c;
}

Checkpoint LoadCheckpoint(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  GEOFP8_CHECK(f.good(), "checkpoint ", path, ": cannot open");
  std::ostringstream os;
  os << f.rdbuf();
  return ParseCheckpoint(os.str(), path);
}

}  // namespace geofp8::train
