// geofp8ctl's version: the project version and `git describe --always --dirty` of the source
// tree, taken at build time (client/ctl/version.cmake writes the header version.cc includes).
#pragma once

namespace geofp8::ctl {
extern const char kVersion[];
extern const char kGitDescribe[];
}  // namespace geofp8::ctl
