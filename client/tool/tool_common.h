// Shared pieces of geofp8-tool's subcommands: the codec flags, file I/O and the error type that
// main() turns into one line "geofp8-tool: error: <field>: <problem> (<value>)" and an exit code.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/codec/codec.h"

namespace geofp8::tool {

// Thrown by subcommands; main() prints what() after "geofp8-tool: error: " and exits with code.
struct ToolError : std::runtime_error {
  ToolError(int exit_code, const std::string& message)
      : std::runtime_error(message), code(exit_code) {}
  int code;  // 2: usage (bad flag value), 1: runtime (I/O, malformed data)
};
[[noreturn]] void UsageError(const std::string& field, const std::string& problem);
[[noreturn]] void RuntimeError(const std::string& field, const std::string& problem);

// Flags every codec subcommand takes, as parsed strings; validated by ToOptions.
struct CodecFlags {
  std::string format = "fp8_e4m3";
  std::string scaling = "block";
  uint32_t block = 128;
  bool block_set = false;  // --block given explicitly
  std::string rounding = "nearest";
  uint64_t seed = 0;
  std::string in;   // input file (required)
  std::string out;  // output file
};

// Adds --format --scaling --block --rounding --seed --in --out to cmd.
void AddCodecFlags(CLI::App* cmd, CodecFlags* flags, bool out_required);

// Validates the flags into CodecOptions; UsageError naming the field on a bad value.
CodecOptions ToOptions(const CodecFlags& flags);

// Reads a raw little-endian float32 file; RuntimeError if missing or its size is not a multiple
// of 4.
std::vector<float> ReadFloats(const std::string& path, const std::string& field = "in");
std::vector<uint8_t> ReadBytes(const std::string& path, const std::string& field = "in");
void WriteBytes(const std::string& path, std::span<const uint8_t> bytes,
                const std::string& field = "out");
void WriteFloats(const std::string& path, std::span<const float> x,
                 const std::string& field = "out");

// "512x512", "1000", "2x3x4" -> dims; UsageError naming `field` if malformed.
std::vector<int64_t> ParseShape(const std::string& text, const std::string& field = "shape");
// UsageError unless the product of dims equals count.
void CheckShape(const std::vector<int64_t>& dims, size_t count, const std::string& text,
                const std::string& field = "shape");

// Prints "geofp8-tool: warning: ..." on stderr if the encode saw non-finite inputs.
void WarnNonFinite(const EncodeStats& stats);

// analyze.cc
void AddAnalyzeCommand(CLI::App& app);
// codec_commands.cc: encode, decode, roundtrip
void AddCodecCommands(CLI::App& app);

}  // namespace geofp8::tool
