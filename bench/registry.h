// Subcommand registry of geofp8-bench: each *_bench.cc registers one subcommand at static init.
// Bench sources are compiled straight into the executable so registration is never dropped.
#pragma once

#include <CLI/CLI.hpp>
#include <string>
#include <vector>

namespace geofp8::bench {

struct Command {
  std::string name;                   // subcommand, e.g. "codec"
  std::string help;                   // one line for `geofp8-bench --help`
  int (*run)(int argc, char** argv);  // argv[0] is the subcommand name
};

std::vector<Command>& Commands();

// Prints "prog: error: field: problem (value)" and exits 2: the usage-error convention of every
// command-line program in this project.
[[noreturn]] void UsageError(const std::string& prog, const std::string& field,
                             const std::string& problem, const std::string& value);

// Parses a subcommand's flags with CLI11 (argv[0] is the subcommand's name), as every program of
// the project does. Returns -1 to go on; otherwise the exit code: 0 after --help, 2 after a usage
// error, printed as "geofp8-bench <command>: error: <CLI11's message, naming the flag>".
int ParseFlags(CLI::App& app, int argc, char** argv);

struct Registrar {
  Registrar(std::string name, std::string help, int (*run)(int, char**)) {
    Commands().push_back({std::move(name), std::move(help), run});
  }
};

}  // namespace geofp8::bench

#define GEOFP8_REGISTER_BENCH(name, help, fn) \
  static const ::geofp8::bench::Registrar geofp8_bench_registrar_##fn(name, help, fn)
