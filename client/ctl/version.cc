#include "client/ctl/version.h"

#include "geofp8ctl_version.h"  // generated in the build folder by version.cmake

namespace geofp8::ctl {
const char kVersion[] = GEOFP8CTL_VERSION;
const char kGitDescribe[] = GEOFP8CTL_GIT_DESCRIBE;
}  // namespace geofp8::ctl
