// The geometry transform fused with the codec (fused.h): row tiles of T(G) go from the GEMM to the
// encoder while in cache, and decoded tiles are finished by T^-1 before they are written out.
#include "kernels/geometry/fused.h"

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "kernels/common/check.h"
#include "kernels/geometry/factors.h"

namespace geofp8 {
namespace {

// ---- Encoding a range piece by piece ----
//
// The wire layout (codec.h) is header | scales | payload, with block-local scales stored in block
// order and elements in input order. A piece that starts and ends on a scale block boundary is
// therefore encoded exactly as the whole range would encode it: its scales and payload are a
// contiguous slice of each part. Encoding the piece on its own and copying the two slices into
// place gives the whole-range bytes without a codec entry point per piece.

// Elements a piece must be a multiple of (except the last), or `size` when only the whole range
// can be encoded at once: a scale over the whole range, or random bits indexed from its start.
size_t EncodeGranule(const CodecOptions& o, size_t size) {
  if (o.rounding == Rounding::kStochastic) return size;
  switch (o.format) {
    case Format::kFp32:
    case Format::kBf16:
      return 1;
    case Format::kFp8E4M3:
    case Format::kFp8E5M2:
      if (o.scaling == Scaling::kNone) return 1;
      if (o.scaling == Scaling::kBlock) return std::max<size_t>(o.block, 1);
      return size;
    case Format::kMxfp8:
      return 32;
    case Format::kNvfp4:
      return size;  // the fp32 tensor scale needs the amax of the whole range
  }
  return size;
}

class StreamEncoder {
 public:
  explicit StreamEncoder(FusedEncodeTarget& t)
      : t_(t),
        size_(t.end - t.begin),
        granule_(std::max<size_t>(EncodeGranule(t.options, size_), 1)),
        scale_total_(ScaleBytes(t.options, size_)) {
    t_.stats = EncodeStats{};
    if (granule_ >= size_) pending_.reserve(size_);
  }

  // x holds the target's next len elements.
  void Feed(const float* x, size_t len) {
    if (pending_.empty()) {
      const size_t now = Encodable(len);
      if (now) Piece(x, now);
      pending_.assign(x + now, x + len);
      return;
    }
    pending_.insert(pending_.end(), x, x + len);
    const size_t now = Encodable(pending_.size());
    if (now) {
      Piece(pending_.data(), now);
      pending_.erase(pending_.begin(), pending_.begin() + static_cast<ptrdiff_t>(now));
    }
  }

  void Finish() {
    GEOFP8_CHECK(done_ == size_ && pending_.empty(), "fused encode: target [", t_.begin, ", ",
                 t_.end, ") received ", done_ + pending_.size(), " elements");
    if (size_ == 0) {
      t_.stats = Encode({}, t_.options, t_.out);
    } else if (!whole_) {
      header_.count = size_;
      header_.flags = flags_;
      std::memcpy(t_.out.data(), &header_, sizeof(header_));
    }
  }

 private:
  size_t Encodable(size_t avail) const {
    if (done_ + avail == size_) return avail;
    return granule_ >= size_ ? 0 : avail / granule_ * granule_;
  }

  void Piece(const float* x, size_t len) {
    const CodecOptions& o = t_.options;
    if (len == size_) {  // the whole range in one piece: encode in place
      t_.stats = Encode({x, len}, o, t_.out);
      whole_ = true;
      done_ = len;
      return;
    }
    tmp_.resize(EncodedBytes(o, len));
    const EncodeStats st = Encode({x, len}, o, tmp_);
    t_.stats.nonfinite += st.nonfinite;
    t_.stats.saturated += st.saturated;
    EncodedHeader h;
    std::memcpy(&h, tmp_.data(), sizeof(h));
    if (done_ == 0) header_ = h;
    flags_ |= h.flags;
    const size_t sb = ScaleBytes(o, len), pb = PayloadBytes(o, len);
    uint8_t* base = t_.out.data() + sizeof(EncodedHeader);
    const uint8_t* src = tmp_.data() + sizeof(EncodedHeader);
    // done_ is a multiple of the scale block, so these are the exact offsets of its slices.
    if (sb) std::memcpy(base + ScaleBytes(o, done_), src, sb);
    std::memcpy(base + scale_total_ + PayloadBytes(o, done_), src + sb, pb);
    done_ += len;
  }

  FusedEncodeTarget& t_;
  const size_t size_, granule_, scale_total_;
  size_t done_ = 0;             // elements encoded so far
  std::vector<float> pending_;  // elements [done_, done_ + pending_.size()) not yet encoded
  std::vector<uint8_t> tmp_;
  EncodedHeader header_;
  uint8_t flags_ = 0;
  bool whole_ = false;
};

// Targets sorted by begin, checked for bounds, sizes and overlap.
std::vector<size_t> SortTargets(std::span<FusedEncodeTarget> targets, size_t total) {
  std::vector<size_t> order(targets.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::pair(targets[a].begin, targets[a].end) <
           std::pair(targets[b].begin, targets[b].end);
  });
  size_t covered = 0;  // end of the non-empty targets so far
  size_t last = 0;
  for (size_t idx = 0; idx < order.size(); ++idx) {
    const FusedEncodeTarget& t = targets[order[idx]];
    if (t.begin > t.end || t.end > total) {
      GEOFP8_FAIL("EncodeWithGeometry: targets[", order[idx], "].begin/end: [", t.begin, ", ",
                  t.end, ") is not a range inside the ", total, " elements of G");
    }
    const std::string error = ValidateCodecOptions(t.options);
    if (!error.empty())
      GEOFP8_FAIL("EncodeWithGeometry: targets[", order[idx], "].options.", error);
    const size_t need = EncodedBytes(t.options, t.end - t.begin);
    if (t.out.size() < need) {
      GEOFP8_FAIL("EncodeWithGeometry: targets[", order[idx], "].out: holds ", t.out.size(),
                  " bytes, needs ", need);
    }
    if (t.begin == t.end) continue;  // an empty range overlaps nothing
    if (covered > t.begin) {
      GEOFP8_FAIL("EncodeWithGeometry: targets[", last, "] and targets[", order[idx],
                  "] overlap at element ", t.begin);
    }
    covered = t.end;
    last = order[idx];
  }
  return order;
}

// ---- Decoding a range ----

EncodedView View(std::span<const uint8_t> in) { return ParseEncoded(in); }

// Elements a decoded slice must start on: one scale entry covers this many.
size_t DecodeGranule(const EncodedHeader& h) {
  switch (static_cast<Format>(h.format)) {
    case Format::kFp8E4M3:
    case Format::kFp8E5M2:
      return static_cast<Scaling>(h.scaling) == Scaling::kBlock ? std::max<uint32_t>(h.block, 1)
                                                                : 1;
    case Format::kMxfp8:
      return 32;
    case Format::kNvfp4:
      return 16;
    default:
      return 1;
  }
}

// Decodes [a, e) of the tensor in v, a a multiple of DecodeGranule, by handing Decode a buffer
// made of the header (count e - a) and the slices of the scales and payload that cover [a, e).
void DecodeSlice(const EncodedView& v, size_t a, size_t e, std::span<float> out,
                 std::vector<uint8_t>& buf) {
  const EncodedHeader& h = v.header;
  auto ceil_div = [](size_t x, size_t d) { return (x + d - 1) / d; };
  size_t s0 = 0, s1 = 0, p0 = 0, p1 = 0;
  size_t prefix = 0;  // nvfp4: the fp32 tensor scale ahead of the block scales
  switch (static_cast<Format>(h.format)) {
    case Format::kFp8E4M3:
    case Format::kFp8E5M2:
      if (static_cast<Scaling>(h.scaling) == Scaling::kBlock) {
        s0 = 4 * (a / h.block);
        s1 = 4 * ceil_div(e, h.block);
      } else if (static_cast<Scaling>(h.scaling) == Scaling::kTensor) {
        s1 = 4;
      }
      p0 = a;
      p1 = e;
      break;
    case Format::kMxfp8:
      s0 = a / 32;
      s1 = ceil_div(e, 32);
      p0 = a;
      p1 = e;
      break;
    case Format::kNvfp4:
      prefix = 4;
      s0 = 4 + a / 16;
      s1 = 4 + ceil_div(e, 16);
      p0 = a / 2;
      p1 = ceil_div(e, 2);
      break;
    case Format::kBf16:
      p0 = 2 * a;
      p1 = 2 * e;
      break;
    case Format::kFp32:
      p0 = 4 * a;
      p1 = 4 * e;
      break;
  }
  buf.resize(sizeof(EncodedHeader) + prefix + (s1 - s0) + (p1 - p0));
  EncodedHeader hh = h;
  hh.count = e - a;
  std::memcpy(buf.data(), &hh, sizeof(hh));
  uint8_t* p = buf.data() + sizeof(hh);
  if (prefix) std::memcpy(p, v.scales.data(), prefix);
  p += prefix;
  if (s1 > s0) std::memcpy(p, v.scales.data() + s0, s1 - s0);
  p += s1 - s0;
  std::memcpy(p, v.payload.data() + p0, p1 - p0);
  Decode(buf, out);
}

void DecodeRangeOf(const EncodedView& v, std::span<const uint8_t> in, size_t first,
                   std::span<float> out, std::vector<uint8_t>& buf) {
  const EncodedHeader& h = v.header;
  GEOFP8_CHECK(first <= h.count && out.size() <= h.count - first, "DecodeRange: elements [", first,
               ", ", first + out.size(), ") are outside the tensor's ", h.count);
  if (out.empty()) return;
  if (first == 0 && out.size() == h.count) return Decode(in, out);
  const size_t g = DecodeGranule(h), end = first + out.size();
  size_t pos = first;
  if (pos % g) {  // a head inside a scale block: decode that block, keep the tail of it
    const size_t a0 = pos / g * g, a1 = std::min<size_t>(a0 + g, h.count);
    std::vector<float> block(a1 - a0);
    DecodeSlice(v, a0, a1, block, buf);
    const size_t take = std::min(end, a1) - pos;
    std::copy_n(block.begin() + static_cast<ptrdiff_t>(pos - a0), take, out.begin());
    pos += take;
  }
  if (pos < end) DecodeSlice(v, pos, end, out.subspan(pos - first), buf);
}

// The decode sources in element order, checked to tile [0, total) exactly.
class Sources {
 public:
  Sources(std::span<const FusedDecodeSource> sources, size_t total) {
    std::vector<size_t> order(sources.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return std::pair(sources[a].begin, sources[a].end) <
             std::pair(sources[b].begin, sources[b].end);
    });
    size_t expect = 0;
    for (size_t idx : order) {
      const FusedDecodeSource& s = sources[idx];
      if (s.begin != expect || s.end < s.begin || s.end > total) {
        GEOFP8_FAIL("DecodeWithGeometry: sources[", idx, "].begin/end: [", s.begin, ", ", s.end,
                    ") does not continue the cover of [0, ", total, ") at element ", expect);
      }
      EncodedView v = View(s.in);
      if (v.header.count != s.end - s.begin) {
        GEOFP8_FAIL("DecodeWithGeometry: sources[", idx, "].in encodes ", v.header.count,
                    " elements but the range [", s.begin, ", ", s.end, ") has ", s.end - s.begin);
      }
      parts_.push_back({s.begin, s.end, s.in, v});
      expect = s.end;
    }
    if (expect != total) {
      GEOFP8_FAIL("DecodeWithGeometry: sources cover [0, ", expect, ") but out has ", total,
                  " elements");
    }
  }

  // Decodes elements [a, a + out.size()) of the matrix.
  void Decode(size_t a, std::span<float> out) {
    if (out.empty()) return;
    const size_t e = a + out.size();
    auto it = std::upper_bound(parts_.begin(), parts_.end(), a,
                               [](size_t x, const Part& p) { return x < p.begin; });
    for (--it; it != parts_.end() && it->begin < e; ++it) {
      const size_t lo = std::max(a, it->begin), hi = std::min(e, it->end);
      if (lo >= hi) continue;
      DecodeRangeOf(it->view, it->in, lo - it->begin, out.subspan(lo - a, hi - lo), buf_);
    }
  }

 private:
  struct Part {
    size_t begin, end;
    std::span<const uint8_t> in;
    EncodedView view;
  };
  std::vector<Part> parts_;
  std::vector<uint8_t> buf_;
};

void CheckMatrix(const Geometry& g, size_t elements, const char* what) {
  GEOFP8_CHECK(g.m >= 0 && g.n >= 0 && static_cast<int64_t>(elements) == g.m * g.n, what,
               ": geometry is for ", g.m, "x", g.n, " but the tensor has ", elements, " elements");
}

}  // namespace

namespace geometry {
void DecodeRange(std::span<const uint8_t> in, size_t first, std::span<float> out) {
  std::vector<uint8_t> buf;
  DecodeRangeOf(View(in), in, first, out, buf);
}
}  // namespace geometry

void EncodeWithGeometry(const Geometry& geometry, std::span<const float> G,
                        std::span<FusedEncodeTarget> targets) {
  const std::vector<size_t> order = SortTargets(targets, G.size());
  std::vector<StreamEncoder> enc;
  enc.reserve(order.size());
  for (size_t idx : order) enc.emplace_back(targets[idx]);

  const bool lowrank = !geometry.is_identity() && geometry.mode == GeometryMode::kLowRank;
  const bool diag = !geometry.is_identity() && geometry.mode == GeometryMode::kDiag;
  geometry::LowRankUpdate update;
  if (lowrank || diag) CheckMatrix(geometry, G.size(), "EncodeWithGeometry");
  if (lowrank) {
    const int64_t n = geometry.n;
    update = geometry::PrepareLowRank(
        geometry, /*inverse=*/false,
        [&](int64_t r0, int64_t, float*) -> const float* { return G.data() + r0 * n; });
  } else if (diag) {
    geometry::CheckDiag(geometry);
  }
  if (!diag && update.identity) {  // T is the identity: encode straight from G
    for (size_t i = 0; i < order.size(); ++i) {
      const FusedEncodeTarget& t = targets[order[i]];
      enc[i].Feed(G.data() + t.begin, t.end - t.begin);
      enc[i].Finish();
    }
    return;
  }
  const int64_t m = geometry.m, n = geometry.n, rows = geometry::TileRows(m, n);
  std::vector<float> tile(static_cast<size_t>(rows * n));
  size_t first = 0;  // first target that can still overlap a tile
  for (int64_t r0 = 0; r0 < m; r0 += rows) {
    const int64_t r1 = std::min(m, r0 + rows);
    const size_t t0 = static_cast<size_t>(r0 * n), t1 = static_cast<size_t>(r1 * n);
    while (first < order.size() && targets[order[first]].end <= t0) ++first;
    if (first == order.size()) break;
    if (targets[order[first]].begin >= t1) continue;  // no target needs these rows
    if (diag) {
      geometry::DiagRows(geometry, r0, r1, G.data() + t0, tile.data(), /*inverse=*/false);
    } else {
      std::memcpy(tile.data(), G.data() + t0, (t1 - t0) * sizeof(float));
      geometry::UpdateRows(update, r0, r1, tile.data());
    }
    for (size_t i = first; i < order.size() && targets[order[i]].begin < t1; ++i) {
      const FusedEncodeTarget& t = targets[order[i]];
      const size_t lo = std::max(t0, t.begin), hi = std::min(t1, t.end);
      if (lo < hi) enc[i].Feed(tile.data() + (lo - t0), hi - lo);
    }
  }
  for (StreamEncoder& e : enc) e.Finish();
}

void DecodeWithGeometry(const Geometry& geometry, std::span<const FusedDecodeSource> sources,
                        std::span<float> out) {
  Sources src(sources, out.size());
  const bool lowrank = !geometry.is_identity() && geometry.mode == GeometryMode::kLowRank;
  const bool diag = !geometry.is_identity() && geometry.mode == GeometryMode::kDiag;
  if (!lowrank && !diag) {
    src.Decode(0, out);
    return;
  }
  CheckMatrix(geometry, out.size(), "DecodeWithGeometry");
  const int64_t m = geometry.m, n = geometry.n, rows = geometry::TileRows(m, n);
  geometry::LowRankUpdate update;
  if (lowrank) {
    update = geometry::PrepareLowRank(
        geometry, /*inverse=*/true, [&](int64_t r0, int64_t r1, float* scratch) -> const float* {
          src.Decode(static_cast<size_t>(r0 * n), {scratch, static_cast<size_t>((r1 - r0) * n)});
          return scratch;
        });
    if (update.identity) {
      src.Decode(0, out);
      return;
    }
  } else {
    geometry::CheckDiag(geometry);
  }
  for (int64_t r0 = 0; r0 < m; r0 += rows) {
    const int64_t r1 = std::min(m, r0 + rows);
    float* dst = out.data() + r0 * n;
    src.Decode(static_cast<size_t>(r0 * n), {dst, static_cast<size_t>((r1 - r0) * n)});
    if (diag) {
      geometry::DiagRows(geometry, r0, r1, dst, dst, /*inverse=*/true);
    } else {
      geometry::UpdateRows(update, r0, r1, dst);
    }
  }
}

}  // namespace geofp8
