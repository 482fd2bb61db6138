// Invariant checks for the numeric core: a failed check throws geofp8::Error carrying file:line
// apart from its message (Error::where).
// Services catch it at the boundary and convert it to absl::Status; the core never sees Status.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace geofp8 {

// The one exception type the core throws. what() is the message alone, one line, for the user
// (job reasons, Python exceptions, CLI errors); where() is the source location that threw it
// ("exchange_policy.cc:103"; empty when constructed without one), for debug logs.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message, std::string where = {})
      : std::runtime_error(message), where_(std::move(where)) {}
  const std::string& where() const { return where_; }

 private:
  std::string where_;
};

// A collective or its rendezvous could not complete: a peer vanished, closed its connections or
// timed out, or the communicator was aborted. Not this rank's fault: a service lets the job's
// coordinator judge (and restart) the attempt rather than fail it.
class TransportError : public Error {
 public:
  using Error::Error;
};

namespace detail {

template <typename E = Error, typename... Args>
[[noreturn]] inline void ThrowError(const char* file, int line, const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  const char* base = file;
  for (const char* p = file; *p; ++p) {
    if (*p == '/') base = p + 1;
  }
  throw E(os.str(), std::string(base) + ":" + std::to_string(line));
}

// GEOFP8_CHECK's: the message parts, or the condition's text when there are none.
template <typename... Args>
[[noreturn]] inline void ThrowCheck(const char* file, int line, const char* condition,
                                    const Args&... args) {
  if constexpr (sizeof...(Args) == 0) {
    ThrowError(file, line, condition);
  } else {
    ThrowError(file, line, args...);
  }
}

}  // namespace detail
}  // namespace geofp8

// GEOFP8_CHECK(cond, "message parts", value, ...): throw geofp8::Error if cond is false. The
// message is the parts alone, written for the user (name the field and the value); the
// condition's text appears only in a check without parts ("check failed: <cond>"). where()
// locates either.
#define GEOFP8_CHECK(cond, ...)                                                        \
  do {                                                                                 \
    if (!(cond)) [[unlikely]] {                                                        \
      ::geofp8::detail::ThrowCheck(__FILE__, __LINE__,                                 \
                                   "check failed: " #cond __VA_OPT__(, ) __VA_ARGS__); \
    }                                                                                  \
  } while (0)

// GEOFP8_FAIL("message parts", ...): unconditional error (bad input reached the core).
#define GEOFP8_FAIL(...) ::geofp8::detail::ThrowError(__FILE__, __LINE__, __VA_ARGS__)
// GEOFP8_FAIL_TRANSPORT(...): the same, as a TransportError.
#define GEOFP8_FAIL_TRANSPORT(...) \
  ::geofp8::detail::ThrowError<::geofp8::TransportError>(__FILE__, __LINE__, __VA_ARGS__)
