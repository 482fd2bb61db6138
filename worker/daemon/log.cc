// Timestamped stderr logging for the worker daemon.
#include "worker/daemon/log.h"

#include <chrono>
#include <cstdio>
#include <ctime>
#include <mutex>

namespace geofp8::worker {
namespace {
std::mutex g_mu;
std::string g_name;
}  // namespace

void SetLogName(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_name = name;
}

void Log(const std::string& message) {
  const auto now = std::chrono::system_clock::now();
  const std::time_t t = std::chrono::system_clock::to_time_t(now);
  const int ms = int(
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count() % 1000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%H:%M:%S", &tm);
  std::lock_guard<std::mutex> lock(g_mu);
  std::fprintf(stderr, "%s.%03dZ geofp8-worker[%s]: %s\n", stamp, ms, g_name.c_str(),
               message.c_str());
  std::fflush(stderr);
}

}  // namespace geofp8::worker
