// Data sources of kernels/model/data.h and the UTF-8 check of kernels/model/tokenizer.h.

#include "kernels/model/data.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "kernels/common/check.h"
#include "kernels/model/tokenizer.h"

namespace geofp8::model {

namespace {
uint64_t Mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
// Counter-based generator: the k-th draw of stream `key` is Mix(key + k * golden).
struct Stream {
  uint64_t key, k = 0;
  uint64_t Next() { return Mix(key ^ Mix(k++)); }
  double Uniform() { return ((Next() >> 11) + 0.5) * 0x1.0p-53; }
};
int Draw(const std::vector<double>& cdf, size_t begin, size_t n, double u) {
  const auto first = cdf.begin() + begin;
  const auto it = std::upper_bound(first, first + n, u);
  return static_cast<int>(std::min<ptrdiff_t>(it - first, ptrdiff_t(n) - 1));
}
}  // namespace

double DataSource::EntropyBound() const { return std::numeric_limits<double>::quiet_NaN(); }

bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    const unsigned char c = s[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    int len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0)
      len = 2, cp = c & 0x1F;
    else if ((c & 0xF0) == 0xE0)
      len = 3, cp = c & 0x0F;
    else if ((c & 0xF8) == 0xF0)
      len = 4, cp = c & 0x07;
    else
      return false;
    if (i + len > n) return false;
    for (int j = 1; j < len; ++j) {
      const unsigned char cc = s[i + j];
      if ((cc & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return false;
    }
    i += len;
  }
  return true;
}

MarkovSource::MarkovSource(const MarkovOptions& o) : options_(o) {
  GEOFP8_CHECK(o.alphabet >= 2 && o.alphabet <= 94, "data.alphabet: must be in [2, 94] (",
               o.alphabet, ")");
  GEOFP8_CHECK(o.successors >= 1 && o.successors <= o.alphabet,
               "data.successors: must be in [1, alphabet] (", o.successors, ")");
  const int A = o.alphabet;
  P_.assign(size_t(A) * A, 0.0);
  Stream rng{Mix(o.seed ^ 0x6d61726b6f76ULL)};
  for (int i = 0; i < A; ++i) {
    // Choose `successors` distinct next states (partial Fisher-Yates), weights ~ Exp(1) + 0.05.
    std::vector<int> perm(A);
    for (int j = 0; j < A; ++j) perm[j] = j;
    double total = 0;
    for (int j = 0; j < o.successors; ++j) {
      const int pick = j + static_cast<int>(rng.Next() % uint64_t(A - j));
      std::swap(perm[j], perm[pick]);
      const double w = -std::log(rng.Uniform()) + 0.05;
      P_[size_t(i) * A + perm[j]] = w;
      total += w;
    }
    for (int j = 0; j < A; ++j) P_[size_t(i) * A + j] /= total;
  }
  // Stationary law by power iteration on the lazy chain (aperiodic even when P is periodic).
  pi_.assign(A, 1.0 / A);
  for (int it = 0; it < 20000; ++it) {
    std::vector<double> next(A, 0.0);
    for (int i = 0; i < A; ++i) {
      for (int j = 0; j < A; ++j) next[j] += pi_[i] * P_[size_t(i) * A + j];
    }
    double diff = 0;
    for (int j = 0; j < A; ++j) {
      next[j] = 0.5 * (next[j] + pi_[j]);
      diff += std::abs(next[j] - pi_[j]);
    }
    pi_ = next;
    if (diff < 1e-15) break;
  }
  entropy_rate_ = 0;
  for (int i = 0; i < A; ++i) {
    for (int j = 0; j < A; ++j) {
      const double p = P_[size_t(i) * A + j];
      if (p > 0) entropy_rate_ -= pi_[i] * p * std::log(p);
    }
  }
  cdf_.resize(P_.size());
  for (int i = 0; i < A; ++i) {
    double c = 0;
    for (int j = 0; j < A; ++j) cdf_[size_t(i) * A + j] = (c += P_[size_t(i) * A + j]);
  }
  pi_cdf_.resize(A);
  double c = 0;
  for (int j = 0; j < A; ++j) pi_cdf_[j] = (c += pi_[j]);
}

void MarkovSource::Sequence(uint64_t index, int length, int32_t* out) const {
  const int A = options_.alphabet;
  Stream rng{Mix(options_.seed * 0x2545F4914F6CDD1DULL ^ Mix(index))};
  int s = Draw(pi_cdf_, 0, A, rng.Uniform());
  for (int t = 0; t < length; ++t) {
    out[t] = 'a' + s;
    s = Draw(cdf_, size_t(s) * A, A, rng.Uniform());
  }
}

void MarkovSource::TrainBatch(int64_t step, int rank, int ranks, int batch, int seq,
                              std::vector<int32_t>* out) const {
  out->resize(size_t(batch) * (seq + 1));
  for (int b = 0; b < batch; ++b) {
    const uint64_t g = (uint64_t(step) * ranks + rank) * batch + b;
    Sequence(g, seq + 1, out->data() + size_t(b) * (seq + 1));
  }
}

void MarkovSource::ValidationBatch(int64_t index, int batch, int seq,
                                   std::vector<int32_t>* out) const {
  out->resize(size_t(batch) * (seq + 1));
  for (int b = 0; b < batch; ++b) {
    const uint64_t g = (1ULL << 62) | (uint64_t(index) * batch + b);
    Sequence(g, seq + 1, out->data() + size_t(b) * (seq + 1));
  }
}

std::string MarkovSource::Describe() const {
  std::ostringstream os;
  os << "markov(seed=" << options_.seed << ", alphabet=" << options_.alphabet
     << ", successors=" << options_.successors << ", entropy_rate=" << entropy_rate_ << " nats)";
  return os.str();
}

TextSource::TextSource(const TextOptions& o) : options_(o) {
  namespace fs = std::filesystem;
  GEOFP8_CHECK(o.validation_fraction > 0 && o.validation_fraction < 1,
               "data.validation_fraction: must be in (0, 1) (", o.validation_fraction, ")");
  std::error_code ec;
  const fs::path root(o.path);
  auto read = [](const fs::path& p, std::string* s) {
    std::ifstream in(p, std::ios::binary);
    if (!in) return false;
    std::ostringstream os;
    os << in.rdbuf();
    *s = os.str();
    return true;
  };
  if (fs::is_directory(root, ec)) {
    std::vector<fs::path> paths;
    for (auto it = fs::recursive_directory_iterator(root, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      if (it->is_regular_file(ec)) paths.push_back(it->path());
    }
    std::sort(paths.begin(), paths.end());
    for (const fs::path& p : paths) {
      if (int64_t(text_.size()) >= o.max_bytes) break;
      std::string s;
      if (!read(p, &s) || s.empty() || !IsValidUtf8(s)) continue;
      text_ += s;
      if (text_.back() != '\n') text_ += '\n';
      ++files_;
    }
    GEOFP8_CHECK(files_ > 0, "data: no readable UTF-8 text file under ", o.path);
  } else if (fs::is_regular_file(root, ec)) {
    GEOFP8_CHECK(read(root, &text_), "data: cannot read ", o.path);
    GEOFP8_CHECK(IsValidUtf8(text_), "data: not valid UTF-8 text: ", o.path);
    files_ = 1;
  } else {
    GEOFP8_FAIL("data: no such file or folder: ", o.path);
  }
  if (int64_t(text_.size()) > o.max_bytes) text_.resize(size_t(o.max_bytes));
  train_end_ = size_t(double(text_.size()) * (1.0 - o.validation_fraction));
}

void TextSource::TrainBatch(int64_t step, int rank, int ranks, int batch, int seq,
                            std::vector<int32_t>* out) const {
  const size_t shard = train_end_ / size_t(ranks);
  const size_t begin = shard * size_t(rank);
  GEOFP8_CHECK(shard >= size_t(seq) + 2, "data: ", options_.path, " has ", train_end_,
               " training bytes, too few for ", ranks, " shards of seq+1 = ", seq + 1);
  const size_t span = shard - size_t(seq + 1) + 1;  // window starts within the shard
  out->resize(size_t(batch) * (seq + 1));
  Stream rng{Mix(options_.seed ^ Mix(uint64_t(step) * 0x9E3779B97F4A7C15ULL + rank))};
  for (int b = 0; b < batch; ++b) {
    const size_t start = begin + size_t(rng.Next() % span);
    for (int t = 0; t <= seq; ++t) {
      (*out)[size_t(b) * (seq + 1) + t] = static_cast<unsigned char>(text_[start + t]);
    }
  }
}

void TextSource::ValidationBatch(int64_t index, int batch, int seq,
                                 std::vector<int32_t>* out) const {
  const size_t n = text_.size() - train_end_;
  GEOFP8_CHECK(n >= size_t(seq) + 1, "data: ", options_.path, " has ", n,
               " held-out bytes, too few for seq+1 = ", seq + 1);
  const size_t windows = n / size_t(seq + 1);
  out->resize(size_t(batch) * (seq + 1));
  for (int b = 0; b < batch; ++b) {
    // Consecutive non-overlapping windows, wrapping around the held-out part.
    const size_t w = (size_t(index) * batch + b) % windows;
    const size_t start = train_end_ + w * size_t(seq + 1);
    for (int t = 0; t <= seq; ++t) {
      (*out)[size_t(b) * (seq + 1) + t] = static_cast<unsigned char>(text_[start + t]);
    }
  }
}

std::string TextSource::Describe() const {
  std::ostringstream os;
  os << "text(" << options_.path << ", files=" << files_ << ", train_bytes=" << train_end_
     << ", validation_bytes=" << validation_bytes() << ")";
  return os.str();
}

std::unique_ptr<DataSource> MakeDataSource(const std::string& spec, uint64_t seed) {
  if (spec == "synthetic" || spec == "markov") {
    MarkovOptions o;
    o.seed = seed;
    return std::make_unique<MarkovSource>(o);
  }
  if (spec.starts_with("markov:")) {
    MarkovOptions o;
    const std::string num = spec.substr(7);
    char* end = nullptr;
    o.seed = std::strtoull(num.c_str(), &end, 10);
    GEOFP8_CHECK(!num.empty() && end && *end == 0, "data: bad markov seed (", spec, ")");
    return std::make_unique<MarkovSource>(o);
  }
  TextOptions o;
  o.path = spec;
  o.seed = seed;
  return std::make_unique<TextSource>(o);
}

}  // namespace geofp8::model
