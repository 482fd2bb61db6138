// Flag handling and file I/O shared by geofp8-tool's subcommands.
#include "client/tool/tool_common.h"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kernels/codec/format.h"

namespace geofp8::tool {

void UsageError(const std::string& field, const std::string& problem) {
  throw ToolError(2, field + ": " + problem);
}
void RuntimeError(const std::string& field, const std::string& problem) {
  throw ToolError(1, field + ": " + problem);
}

void AddCodecFlags(CLI::App* cmd, CodecFlags* f, bool out_required) {
  cmd->add_option("--format", f->format, "fp32, bf16, fp8_e4m3, fp8_e5m2, mxfp8, nvfp4")
      ->capture_default_str();
  cmd->add_option("--scaling", f->scaling, "none, tensor, block")->capture_default_str();
  cmd->add_option_function<uint32_t>(
         "--block", [f](const uint32_t& b) { f->block = b, f->block_set = true; },
         "elements per scale block (block scaling; mxfp8 is always 32, nvfp4 16)")
      ->default_str("128");
  cmd->add_option("--rounding", f->rounding, "nearest, stochastic")->capture_default_str();
  cmd->add_option("--seed", f->seed, "stochastic rounding seed")->capture_default_str();
  cmd->add_option("--in", f->in, "input file")->required();
  auto* out = cmd->add_option("--out", f->out, "output file");
  if (out_required) out->required();
}

CodecOptions ToOptions(const CodecFlags& f) {
  CodecOptions o;
  const auto format = ParseFormat(f.format);
  if (!format) {
    UsageError("format",
               "unknown format (" + f.format + "); accepted: " + std::string(AcceptedFormats()));
  }
  const auto scaling = ParseScaling(f.scaling);
  if (!scaling) {
    UsageError("scaling",
               "unknown scaling (" + f.scaling + "); accepted: " + std::string(AcceptedScalings()));
  }
  const auto rounding = ParseRounding(f.rounding);
  if (!rounding) {
    UsageError("rounding", "unknown rounding (" + f.rounding +
                               "); accepted: " + std::string(AcceptedRoundings()));
  }
  o.format = *format;
  o.scaling = *scaling;
  o.rounding = *rounding;
  o.block = f.block;
  o.seed = f.seed;
  if (f.block == 0) UsageError("block", "must be at least 1 (0)");
  if (f.block > (1u << 30))
    UsageError("block", "implausibly large (" + std::to_string(f.block) + ")");
  if (f.block_set && o.format == Format::kMxfp8 && f.block != 32) {
    UsageError("block", "mxfp8 always uses blocks of 32 (" + std::to_string(f.block) + ")");
  }
  if (f.block_set && o.format == Format::kNvfp4 && f.block != 16) {
    UsageError("block", "nvfp4 always uses blocks of 16 (" + std::to_string(f.block) + ")");
  }
  if (f.block_set && o.scaling != Scaling::kBlock &&
      (o.format == Format::kFp8E4M3 || o.format == Format::kFp8E5M2)) {
    UsageError("block", "given with --scaling " + f.scaling + " (" + std::to_string(f.block) +
                            "); use --scaling block");
  }
  const std::string error = ValidateCodecOptions(o);
  if (!error.empty()) throw ToolError(2, error);
  return o;
}

std::vector<uint8_t> ReadBytes(const std::string& path, const std::string& field) {
  // An ifstream opens a directory, and its tellg() then reports a size that ends in bad_alloc.
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    UsageError(field, "is a directory, expected a file (" + path + ")");
  }
  std::ifstream is(path, std::ios::binary | std::ios::ate);
  if (!is) RuntimeError(field, "cannot open file (" + path + ")");
  const std::streamoff size = is.tellg();
  if (size < 0) RuntimeError(field, "cannot read file (" + path + ")");
  std::vector<uint8_t> bytes(static_cast<size_t>(size));
  is.seekg(0);
  if (size && !is.read(reinterpret_cast<char*>(bytes.data()), size)) {
    RuntimeError(field, "read failed (" + path + ")");
  }
  return bytes;
}

std::vector<float> ReadFloats(const std::string& path, const std::string& field) {
  const std::vector<uint8_t> bytes = ReadBytes(path, field);
  if (bytes.size() % 4) {
    RuntimeError(field, "file size is not a multiple of 4 bytes (" + std::to_string(bytes.size()) +
                            " bytes in " + path + ")");
  }
  std::vector<float> x(bytes.size() / 4);
  if (!x.empty()) std::memcpy(x.data(), bytes.data(), bytes.size());
  return x;
}

void WriteBytes(const std::string& path, std::span<const uint8_t> bytes, const std::string& field) {
  std::ofstream os(path, std::ios::binary | std::ios::trunc);
  if (!os) RuntimeError(field, "cannot create file (" + path + ")");
  os.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!os) RuntimeError(field, "write failed (" + path + ")");
}

void WriteFloats(const std::string& path, std::span<const float> x, const std::string& field) {
  WriteBytes(path, {reinterpret_cast<const uint8_t*>(x.data()), x.size() * 4}, field);
}

std::vector<int64_t> ParseShape(const std::string& text, const std::string& field) {
  std::vector<int64_t> dims;
  size_t pos = 0;
  while (true) {
    const size_t x = text.find('x', pos);
    const std::string part = text.substr(pos, x == std::string::npos ? std::string::npos : x - pos);
    if (part.empty() || part.find_first_not_of("0123456789") != std::string::npos ||
        part.size() > 12) {
      UsageError(field, "expected dimensions like 512x512 (" + text + ")");
    }
    dims.push_back(std::stoll(part));
    if (x == std::string::npos) break;
    pos = x + 1;
  }
  return dims;
}

void CheckShape(const std::vector<int64_t>& dims, size_t count, const std::string& text,
                const std::string& field) {
  long double product = 1;
  for (int64_t d : dims) product *= static_cast<long double>(d);
  if (product != static_cast<long double>(count)) {
    std::ostringstream os;
    os << "shape " << text << " has " << static_cast<unsigned long long>(product)
       << " elements but the input holds " << count << " (" << text << ")";
    UsageError(field, os.str());
  }
}

void WarnNonFinite(const EncodeStats& stats) {
  if (stats.nonfinite) {
    std::fprintf(stderr,
                 "geofp8-tool: warning: in: %llu non-finite input values (flagged; encoded as "
                 "non-finite)\n",
                 static_cast<unsigned long long>(stats.nonfinite));
  }
}

}  // namespace geofp8::tool
