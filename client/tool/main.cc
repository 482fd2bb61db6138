// geofp8-tool: the codec on raw little-endian float32 files (encode, decode, roundtrip, analyze).
// Errors are one line "geofp8-tool: error: <field>: <problem> (<value>)"; exit 2 usage, 1 runtime.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "client/tool/tool_common.h"
#include "kernels/common/check.h"

int main(int argc, char** argv) {
  CLI::App app{"geofp8-tool: low-precision codec on raw float32 files", "geofp8-tool"};
  app.require_subcommand(1);
  geofp8::tool::AddCodecCommands(app);
  geofp8::tool::AddAnalyzeCommand(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::string msg = e.what();
    for (char& c : msg) c = c == '\n' ? ' ' : c;
    std::fprintf(stderr, "geofp8-tool: error: %s\n", msg.c_str());
    return 2;
  } catch (const geofp8::tool::ToolError& e) {
    std::fprintf(stderr, "geofp8-tool: error: %s\n", e.what());
    return e.code;
  } catch (const geofp8::Error& e) {
    std::fprintf(stderr, "geofp8-tool: error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "geofp8-tool: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
