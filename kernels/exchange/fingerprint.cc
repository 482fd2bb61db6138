// Cross-rank fingerprint check of the buckets of one run (see fingerprint.h).
#include "kernels/exchange/fingerprint.h"

#include <cstring>
#include <map>
#include <sstream>

#include "kernels/common/check.h"

namespace geofp8 {

uint64_t Fnv1a(const void* data, size_t bytes, uint64_t h) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

namespace {

std::string NameOf(uint32_t layer, std::span<const std::string> names) {
  std::ostringstream os;
  os << "layer " << layer;
  if (layer < names.size() && !names[layer].empty()) os << " '" << names[layer] << "'";
  return os.str();
}

// Index of the record that most ranks hold (ties: lowest rank), by bytewise equality.
template <typename T, typename Eq>
int MajorityRank(const std::vector<T>& records, Eq eq) {
  int best = 0, best_count = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    int count = 0;
    for (const auto& r : records) count += eq(records[i], r);
    if (count > best_count) best = static_cast<int>(i), best_count = count;
  }
  return best;
}

std::string DescribeLayerDifference(const LayerRecord& a, const LayerRecord& ref) {
  std::ostringstream os;
  auto fmt = [](uint8_t f) { return std::string(FormatName(static_cast<Format>(f))); };
  if (a.layer != ref.layer) {
    os << "holds layer " << a.layer << " where rank majority holds layer " << ref.layer;
  } else if (a.format != ref.format) {
    os << "format " << fmt(a.format) << " (others: " << fmt(ref.format) << ")";
  } else if (a.scaling != ref.scaling) {
    os << "scaling " << ScalingName(static_cast<Scaling>(a.scaling))
       << " (others: " << ScalingName(static_cast<Scaling>(ref.scaling)) << ")";
  } else if (a.rounding != ref.rounding) {
    os << "rounding " << RoundingName(static_cast<Rounding>(a.rounding))
       << " (others: " << RoundingName(static_cast<Rounding>(ref.rounding)) << ")";
  } else if (a.block != ref.block) {
    os << "block " << a.block << " (others: " << ref.block << ")";
  } else if (a.rows != ref.rows || a.cols != ref.cols) {
    os << "shape " << a.rows << "x" << a.cols << " (others: " << ref.rows << "x" << ref.cols << ")";
  } else if (a.geometry != ref.geometry) {
    os << "geometry " << GeometryModeName(static_cast<GeometryMode>(a.geometry))
       << " (others: " << GeometryModeName(static_cast<GeometryMode>(ref.geometry)) << ")";
  } else if (a.geometry_version != ref.geometry_version) {
    os << "geometry version " << a.geometry_version << " (others: " << ref.geometry_version << ")";
  } else if (a.geometry_digest != ref.geometry_digest) {
    os << "geometry digest " << std::hex << a.geometry_digest << " (others: " << ref.geometry_digest
       << std::dec
       << "): the ranks derived different transforms from the same version, e.g. "
          "different CPU kernels; every rank must compute the sketch identically";
  } else if (a.error_feedback != ref.error_feedback) {
    os << "error_feedback " << (a.error_feedback ? "on" : "off")
       << " (others: " << (ref.error_feedback ? "on" : "off") << ")";
  } else if (a.hadamard_block != ref.hadamard_block) {
    os << "hadamard_block " << a.hadamard_block << " (others: " << ref.hadamard_block << ")";
  } else if (a.rank_k != ref.rank_k || std::memcmp(&a.alpha, &ref.alpha, 4) != 0) {
    os << "geometry rank/alpha " << a.rank_k << "/" << a.alpha << " (others: " << ref.rank_k << "/"
       << ref.alpha << ")";
  } else {
    os << "a different layer record";
  }
  return os.str();
}

// One bucket's check: the gather of its BucketRecord, then of its layer records if they differ.
void CheckBucket(Communicator& comm, const BucketRecord& record,
                 std::span<const LayerRecord> layers, std::span<const std::string> layer_names) {
  const int n = comm.size();
  std::vector<BucketRecord> all(n);
  std::vector<size_t> counts(n, sizeof(BucketRecord));
  comm.AllGatherV({reinterpret_cast<const uint8_t*>(&record), sizeof record},
                  {reinterpret_cast<uint8_t*>(all.data()), all.size() * sizeof(BucketRecord)},
                  counts);

  auto same = [](const BucketRecord& a, const BucketRecord& b) {
    return a.policy_version == b.policy_version && a.step == b.step && a.digest == b.digest &&
           a.bucket == b.bucket && a.layer_count == b.layer_count && a.algorithm == b.algorithm;
  };
  bool agree = true;
  for (const auto& r : all) agree = agree && same(r, all[0]);
  if (agree) return;

  // Every rank saw the same records, so every rank takes this path and the second gather below
  // is matched on all of them. Policy version, step, bucket and algorithm already agree (the run
  // record covers them), so only the layers can differ.
  const int ref = MajorityRank(all, same);
  const BucketRecord& R = all[ref];
  std::ostringstream msg;
  msg << "exchange fingerprint mismatch in bucket " << R.bucket << " at step " << R.step << ": ";
  // Layers differ: gather every rank's layer records (sizes known from the first gather).
  std::vector<size_t> layer_counts(n);
  size_t total = 0;
  for (int r = 0; r < n; ++r) total += layer_counts[r] = all[r].layer_count * sizeof(LayerRecord);
  std::vector<LayerRecord> gathered(total / sizeof(LayerRecord));
  comm.AllGatherV({reinterpret_cast<const uint8_t*>(layers.data()), layers.size_bytes()},
                  {reinterpret_cast<uint8_t*>(gathered.data()), total}, layer_counts);
  std::vector<std::span<const LayerRecord>> per_rank(n);
  size_t off = 0;
  for (int r = 0; r < n; ++r) {
    per_rank[r] = std::span<const LayerRecord>(gathered).subspan(off, all[r].layer_count);
    off += all[r].layer_count;
  }
  const auto& ref_layers = per_rank[ref];
  for (int r = 0; r < n; ++r) {
    const auto& mine = per_rank[r];
    for (size_t i = 0; i < std::max(mine.size(), ref_layers.size()); ++i) {
      if (i >= mine.size()) {
        msg << "rank " << r << " lacks " << NameOf(ref_layers[i].layer, layer_names)
            << " that rank " << ref << " sends";
        GEOFP8_FAIL(msg.str());
      }
      if (i >= ref_layers.size()) {
        msg << "rank " << r << " sends " << NameOf(mine[i].layer, layer_names) << " that rank "
            << ref << " does not";
        GEOFP8_FAIL(msg.str());
      }
      if (std::memcmp(&mine[i], &ref_layers[i], sizeof(LayerRecord)) != 0) {
        msg << "rank " << r << " " << NameOf(mine[i].layer, layer_names) << " has "
            << DescribeLayerDifference(mine[i], ref_layers[i]) << " vs rank " << ref;
        GEOFP8_FAIL(msg.str());
      }
    }
  }
  msg << "records differ but no layer does (digest collision?)";
  GEOFP8_FAIL(msg.str());
}

}  // namespace

uint64_t LayerDigest(std::span<const LayerRecord> layers) {
  return Fnv1a(layers.data(), layers.size_bytes());
}

RunRecord MakeRunRecord(std::span<const BucketFingerprint> buckets,
                        std::vector<BucketRecord>* headers) {
  GEOFP8_CHECK(!buckets.empty(), "fingerprint check: no buckets");
  RunRecord run;
  run.policy_version = buckets[0].header.policy_version;
  run.step = buckets[0].header.step;
  run.first_bucket = buckets[0].header.bucket;
  run.bucket_count = static_cast<uint32_t>(buckets.size());
  run.algorithm = buckets[0].header.algorithm;
  run.digest = Fnv1a(nullptr, 0);
  for (const BucketFingerprint& b : buckets) {
    GEOFP8_CHECK(b.header.policy_version == run.policy_version && b.header.step == run.step &&
                     b.header.algorithm == run.algorithm,
                 "fingerprint check: bucket ", b.header.bucket,
                 " differs from the run's policy version, step or algorithm");
    BucketRecord h = b.header;
    h.layer_count = static_cast<uint32_t>(b.layers.size());
    h.digest = LayerDigest(b.layers);
    run.digest = Fnv1a(&h, sizeof h, run.digest);
    if (headers) headers->push_back(h);
  }
  return run;
}

void CheckFingerprints(Communicator& comm, std::span<const BucketFingerprint> buckets,
                       std::span<const std::string> layer_names) {
  const RunRecord run = MakeRunRecord(buckets);
  // The common case in one small reduction: every rank holds the same record iff, word by word,
  // the maximum over ranks equals the minimum (the complement of the maximum of complements).
  constexpr size_t kWords = sizeof(RunRecord) / sizeof(uint64_t);
  static_assert(2 * kWords <= Communicator::kMaxReduceWords);
  uint64_t words[2 * kWords];
  std::memcpy(words, &run, sizeof run);
  for (size_t i = 0; i < kWords; ++i) words[kWords + i] = ~words[i];
  comm.MaxReduceWords(words);
  bool agree = true;
  for (size_t i = 0; i < kWords; ++i) agree = agree && words[i] == ~words[kWords + i];
  if (agree) return;
  // Some rank differs; every rank saw the same reduction, so every rank diagnoses.
  DiagnoseFingerprints(comm, buckets, layer_names);
}

void DiagnoseFingerprints(Communicator& comm, std::span<const BucketFingerprint> buckets,
                          std::span<const std::string> layer_names) {
  const int n = comm.size();
  std::vector<BucketRecord> headers;
  const RunRecord run = MakeRunRecord(buckets, &headers);
  // Every rank takes this path, so each gather below is matched on all of them.
  std::vector<RunRecord> all(n);
  comm.AllGatherV({reinterpret_cast<const uint8_t*>(&run), sizeof run},
                  {reinterpret_cast<uint8_t*>(all.data()), all.size() * sizeof(RunRecord)},
                  std::vector<size_t>(n, sizeof(RunRecord)));
  auto same_shape = [](const RunRecord& a, const RunRecord& b) {
    return a.policy_version == b.policy_version && a.step == b.step &&
           a.first_bucket == b.first_bucket && a.bucket_count == b.bucket_count &&
           a.algorithm == b.algorithm;
  };
  const int ref = MajorityRank(all, same_shape);
  const RunRecord& R = all[ref];
  auto range = [](const RunRecord& a) {
    std::ostringstream os;
    if (a.bucket_count == 1) {
      os << "bucket " << a.first_bucket;
    } else {
      os << "buckets " << a.first_bucket << ".." << a.first_bucket + a.bucket_count - 1;
    }
    return os.str();
  };
  std::ostringstream msg;
  msg << "exchange fingerprint mismatch in " << range(R) << " at step " << R.step << ": ";
  for (int r = 0; r < n; ++r) {
    const RunRecord& a = all[r];
    if (a.policy_version != R.policy_version) {
      msg << "rank " << r << " has policy version " << a.policy_version << ", rank " << ref
          << " has " << R.policy_version;
      GEOFP8_FAIL(msg.str());
    }
    if (!same_shape(a, R)) {
      msg << "rank " << r << " is at step " << a.step << " " << range(a) << " algorithm "
          << AlgorithmName(static_cast<Algorithm>(a.algorithm)) << ", rank " << ref << " at step "
          << R.step << " " << range(R) << " algorithm "
          << AlgorithmName(static_cast<Algorithm>(R.algorithm));
      GEOFP8_FAIL(msg.str());
    }
  }
  // Same buckets everywhere, different layers in at least one: find it bucket by bucket.
  for (size_t b = 0; b < buckets.size(); ++b) {
    CheckBucket(comm, headers[b], buckets[b].layers, layer_names);
  }
  msg << "bucket digests differ but no bucket does (digest collision?)";
  GEOFP8_FAIL(msg.str());
}

}  // namespace geofp8
