// geofp8-bench: one binary, one subcommand per subsystem (codec, geometry, exchange, ...).
// Every benchmark prints ratios against a baseline measured in the same run.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

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

int ParseFlags(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    std::fprintf(stderr, "geofp8-bench %s: error: %s\n", app.get_name().c_str(), e.what());
    return 2;
  }
  return -1;
}
}  // namespace geofp8::bench

int main(int argc, char** argv) {
  // The geometry and model benches time OpenBLAS: use the kernels this CPU supports (see
  // kernels/model/ops.h); the chosen core is part of what a run reports.
  std::string blas_warning;
  geofp8::model::ReexecWithPreferredBlasCore(argv, &blas_warning);
  if (!blas_warning.empty())
    std::fprintf(stderr, "geofp8-bench: warning: %s\n", blas_warning.c_str());
  auto commands = geofp8::bench::Commands();
  std::sort(commands.begin(), commands.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  CLI::App app{
      "One subcommand per subsystem; every benchmark prints ratios against a baseline measured "
      "in the same run. `geofp8-bench <command> --help` lists a command's options.",
      "geofp8-bench"};
  app.require_subcommand(1);
  for (const auto& c : commands) {
    // The subcommand parses its own flags (and its own --help): everything after its name goes
    // to it.
    CLI::App* sub = app.add_subcommand(c.name, c.help);
    sub->prefix_command();
    sub->set_help_flag();
  }
  // CLI11 would call an unknown name only "a subcommand is required"; name it.
  if (argc > 1 && argv[1][0] != '-' &&
      std::none_of(commands.begin(), commands.end(),
                   [&](const auto& c) { return c.name == argv[1]; })) {
    std::string accepted;
    for (const auto& c : commands) accepted += (accepted.empty() ? "" : ", ") + c.name;
    geofp8::bench::UsageError("geofp8-bench", "command", "unknown, accepted: " + accepted, argv[1]);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);
    std::fprintf(stderr, "geofp8-bench: error: %s\n", e.what());
    std::fprintf(stderr, "%s", app.help().c_str());
    return 2;
  }
  const CLI::App* chosen = app.get_subcommands().front();
  for (const auto& c : commands) {
    if (c.name != chosen->get_name()) continue;
    std::vector<std::string> args = {c.name};
    for (const std::string& r : chosen->remaining()) args.push_back(r);
    std::vector<char*> sub_argv;
    for (std::string& a : args) sub_argv.push_back(a.data());
    sub_argv.push_back(nullptr);
    return c.run(int(args.size()), sub_argv.data());
  }
  return 2;  // unreachable: CLI11 accepted only registered names
}
