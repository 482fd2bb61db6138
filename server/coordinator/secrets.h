// Secrets the coordinator hands out or checks: the bearer token and the workers' per-generation
// session secrets. Header-only; no secret is ever logged.
#pragma once

#include <sys/random.h>

#include <cerrno>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace geofp8::coordinator {

// 128 random bits from the kernel's CSPRNG, as 32 lower-case hex digits.
inline std::string RandomSecret() {
  uint8_t bytes[16];
  size_t got = 0;
  while (got < sizeof bytes) {
    const ssize_t n = ::getrandom(bytes + got, sizeof bytes - got, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw std::runtime_error("getrandom failed: cannot make a session secret");
    got += static_cast<size_t>(n);
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s(2 * sizeof bytes, '0');
  for (size_t i = 0; i < sizeof bytes; ++i) {
    s[2 * i] = kHex[bytes[i] >> 4];
    s[2 * i + 1] = kHex[bytes[i] & 15];
  }
  return s;
}

// Compares in time that depends only on expected's length, not on where got differs.
inline bool SecretEquals(std::string_view expected, std::string_view got) {
  unsigned diff = got.size() != expected.size();
  for (size_t i = 0; i < expected.size(); ++i) {
    diff |= static_cast<unsigned>(expected[i] ^ (i < got.size() ? got[i] : 0));
  }
  return diff == 0;
}

}  // namespace geofp8::coordinator
