// geofp8-tool encode | decode | roundtrip: float32 files to the codec's wire format and back.
#include <cstdio>
#include <memory>

#include "client/tool/tool_common.h"
#include "kernels/codec/codec.h"
#include "kernels/codec/error_metrics.h"
#include "kernels/codec/raw.h"
#include "kernels/common/check.h"

namespace geofp8::tool {
namespace {

// geofp8::Error's message carries no source location (Error::where() keeps it); a failed check
// reads "check failed: <condition>: message", and the tool's one-line error keeps the message.
std::string WithoutLocation(const Error& e) {
  std::string what = e.what();
  if (what.rfind("check failed: ", 0) == 0) {
    const size_t colon = what.find(": ", 14);
    if (colon != std::string::npos) what = what.substr(colon + 2);
  }
  return what;
}

struct EncodeArgs {
  CodecFlags codec;
  bool raw = false;
  std::string shape;
};

void RunEncode(const EncodeArgs& a) {
  const CodecOptions o = ToOptions(a.codec);
  if (a.raw && o.scaling != Scaling::kNone) {
    UsageError("raw", "needs --scaling none (got " + a.codec.scaling + ")");
  }
  const std::vector<float> x = ReadFloats(a.codec.in);
  if (!a.shape.empty()) CheckShape(ParseShape(a.shape), x.size(), a.shape);
  std::vector<uint8_t> out;
  EncodeStats st;
  if (a.raw) {
    out.resize(RawBytes(o.format, x.size()));
    st = EncodeRaw(x, o, out);
  } else {
    out.resize(EncodedBytes(o, x.size()));
    st = Encode(x, o, out);
  }
  WarnNonFinite(st);
  WriteBytes(a.codec.out, out);
}

struct DecodeArgs {
  std::string in, out;
  bool raw = false;
  std::string format;  // only with --raw
  std::string shape;
  bool accumulate = false;
};

void RunDecode(const DecodeArgs& a) {
  const std::vector<uint8_t> bytes = ReadBytes(a.in);
  std::vector<float> out;
  if (a.raw) {
    if (a.format.empty()) UsageError("format", "required with --raw");
    const auto f = ParseFormat(a.format);
    if (!f) {
      UsageError("format",
                 "unknown format (" + a.format + "); accepted: " + std::string(AcceptedFormats()));
    }
    const int bits = FormatBits(*f);
    size_t n = bytes.size() * 8 / bits;
    if (bits >= 8 && bytes.size() % (bits / 8)) {
      RuntimeError("in", "raw " + a.format + " file size is not a multiple of " +
                             std::to_string(bits / 8) + " (" + std::to_string(bytes.size()) + ")");
    }
    // nvfp4: an odd element count leaves the last high nibble unused; --shape says which.
    if (!a.shape.empty()) {
      const auto dims = ParseShape(a.shape);
      size_t want = 1;
      for (auto d : dims) want *= static_cast<size_t>(d);
      if (RawBytes(*f, want) != bytes.size()) CheckShape(dims, n, a.shape);
      n = want;
    }
    out.resize(n);
    try {
      DecodeRaw(bytes, *f, out);
    } catch (const Error& e) {
      RuntimeError("in", WithoutLocation(e));
    }
  } else {
    if (!a.format.empty()) UsageError("format", "only with --raw (the header names the format)");
    EncodedView v;
    try {
      v = ParseEncoded(bytes);
    } catch (const Error& e) {
      RuntimeError("in", WithoutLocation(e));
    }
    const size_t need = sizeof(EncodedHeader) + v.scales.size() + v.payload.size();
    if (bytes.size() != need) {
      RuntimeError("in", "trailing bytes after the encoded tensor (" +
                             std::to_string(bytes.size()) + " bytes, expected " +
                             std::to_string(need) + ")");
    }
    if (!a.shape.empty()) CheckShape(ParseShape(a.shape), v.header.count, a.shape);
    out.assign(v.header.count, 0.f);
    Decode(bytes, out);
    if (v.header.flags & kFlagNonFinite) {
      std::fprintf(stderr,
                   "geofp8-tool: warning: in: encoded tensor carries the non-finite flag\n");
    }
  }
  WriteFloats(a.out, out);
}

struct RoundtripArgs {
  CodecFlags codec;
  std::string shape;
};

void RunRoundtrip(const RoundtripArgs& a) {
  const CodecOptions o = ToOptions(a.codec);
  const std::vector<float> x = ReadFloats(a.codec.in);
  if (!a.shape.empty()) CheckShape(ParseShape(a.shape), x.size(), a.shape);
  std::vector<uint8_t> buf(EncodedBytes(o, x.size()));
  const EncodeStats st = Encode(x, o, buf);
  WarnNonFinite(st);
  std::vector<float> y(x.size());
  Decode(buf, y);
  if (!a.codec.out.empty()) WriteFloats(a.codec.out, y);
  const ErrorMetrics m = ComputeErrorMetrics(x, y, st.saturated);
  std::printf("count=%zu encoded_bytes=%zu rel_fro_error=%.6g max_abs_error=%.6g nonfinite=%llu\n",
              x.size(), buf.size(), m.rel_fro_error, m.max_abs_error,
              static_cast<unsigned long long>(st.nonfinite));
}

}  // namespace

void AddCodecCommands(CLI::App& app) {
  auto enc_args = std::make_shared<EncodeArgs>();
  CLI::App* enc = app.add_subcommand("encode", "float32 file -> encoded wire buffer");
  AddCodecFlags(enc, &enc_args->codec, /*out_required=*/true);
  enc->add_flag("--raw", enc_args->raw,
                "write payload bytes only (needs --scaling none): one byte per FP8 element, two "
                "nvfp4 elements per byte (element 2i in the low nibble)");
  enc->add_option("--shape", enc_args->shape, "expected shape, e.g. 512x512 (checked)");
  enc->callback([enc_args] { RunEncode(*enc_args); });

  auto dec_args = std::make_shared<DecodeArgs>();
  CLI::App* dec = app.add_subcommand("decode", "encoded wire buffer -> float32 file");
  dec->add_option("--in", dec_args->in, "encoded file")->required();
  dec->add_option("--out", dec_args->out, "float32 output file")->required();
  dec->add_flag("--raw", dec_args->raw, "input is raw payload bytes (scale 1); needs --format");
  dec->add_option("--format", dec_args->format, "format of a --raw input");
  dec->add_option("--shape", dec_args->shape, "expected shape, e.g. 512x512 (checked)");
  dec->callback([dec_args] { RunDecode(*dec_args); });

  auto rt_args = std::make_shared<RoundtripArgs>();
  CLI::App* rt = app.add_subcommand("roundtrip", "encode then decode; prints a one-line summary");
  AddCodecFlags(rt, &rt_args->codec, /*out_required=*/false);
  rt->add_option("--shape", rt_args->shape, "expected shape, e.g. 512x512 (checked)");
  rt->callback([rt_args] { RunRoundtrip(*rt_args); });
}

}  // namespace geofp8::tool
