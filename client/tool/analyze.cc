// geofp8-tool analyze: encode + decode a float32 file and print the quality metrics as JSON
// (kernels/codec/error_metrics.h); --out also writes the decoded float32 file.
#include <cstdio>
#include <memory>

#include "client/tool/tool_common.h"
#include "kernels/codec/error_metrics.h"

namespace geofp8::tool {
namespace {

struct AnalyzeArgs {
  CodecFlags codec;
};

void RunAnalyze(const AnalyzeArgs& a) {
  const CodecOptions o = ToOptions(a.codec);
  const std::vector<float> x = ReadFloats(a.codec.in);
  std::vector<float> decoded;
  const CodecReport report = AnalyzeCodec(x, o, &decoded);
  std::printf("%s\n", CodecReportJson(report).c_str());
  if (!a.codec.out.empty()) WriteFloats(a.codec.out, decoded);
}

}  // namespace

void AddAnalyzeCommand(CLI::App& app) {
  auto args = std::make_shared<AnalyzeArgs>();
  CLI::App* cmd = app.add_subcommand(
      "analyze", "encode + decode, print JSON error metrics and sizes (--out: decoded floats)");
  AddCodecFlags(cmd, &args->codec, /*out_required=*/false);
  cmd->callback([args] { RunAnalyze(*args); });
}

}  // namespace geofp8::tool
