// geofp8-bench: one binary, one subcommand per subsystem (codec, geometry, exchange, ...).
// Every benchmark prints ratios against a baseline measured in the same run.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "bench/registry.h"
#include "kernels/model/ops.h"

namespace geofp8::bench {
std::vector<Command>& Commands() {
  static std::vector<Command> commands;
  return commands;
}

void UsageError(const std::string& prog, const std::string& field, const std::string& problem,
                const std::string& value) {
  std::fprintf(stderr, "%s: error: %s: %s (%s)\n", prog.c_str(), field.c_str(), problem.c_str(),
               value.c_str());
  std::exit(2);
}
}  // namespace geofp8::bench

namespace {
void Usage(FILE* out) {
  auto commands = geofp8::bench::Commands();
  std::sort(commands.begin(), commands.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  std::fprintf(out, "usage: geofp8-bench <command> [options]   (<command> --help for options)\n\n");
  for (const auto& c : commands) std::fprintf(out, "  %-12s %s\n", c.name.c_str(), c.help.c_str());
}
}  // namespace

int main(int argc, char** argv) {
  // The geometry and model benches time OpenBLAS: use the kernels this CPU supports (see
  // kernels/model/ops.h); the chosen core is part of what a run reports.
  std::string blas_warning;
  geofp8::model::ReexecWithPreferredBlasCore(argv, &blas_warning);
  if (!blas_warning.empty())
    std::fprintf(stderr, "geofp8-bench: warning: %s\n", blas_warning.c_str());
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    Usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (const auto& c : geofp8::bench::Commands()) {
    if (c.name == argv[1]) return c.run(argc - 1, argv + 1);
  }
  std::fprintf(stderr, "geofp8-bench: unknown command '%s'\n", argv[1]);
  Usage(stderr);
  return 2;
}
