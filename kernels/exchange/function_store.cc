// See function_store.h.
#include "kernels/exchange/function_store.h"

#include <exception>

#include "kernels/common/check.h"

namespace geofp8 {
namespace {

// f(), its exception (any) a geofp8::Error naming the store call `what`.
template <typename F>
auto Named(const std::string& what, F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const std::exception& e) {
    GEOFP8_FAIL("store ", what, ": ", e.what());
  }
}

}  // namespace

void FunctionStore::Set(const std::string& key, const std::vector<uint8_t>& value) {
  Named("set '" + key + "'", [&] { calls_.set(key, value); });
}

std::vector<uint8_t> FunctionStore::Get(const std::string& key, std::chrono::milliseconds timeout) {
  Wait({key}, timeout);
  return Named("get '" + key + "'", [&] { return calls_.get(key); });
}

void FunctionStore::Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const std::string what = "wait for '" + (keys.empty() ? std::string() : keys.front()) + "' (" +
                           std::to_string(keys.size()) + " keys, timeout " +
                           std::to_string(timeout.count()) + " ms)";
  Named(what, [&] { calls_.wait(keys, timeout); });
}

int64_t FunctionStore::Add(const std::string& key, int64_t delta) {
  return Named("add '" + key + "'", [&] { return calls_.add(key, delta); });
}

}  // namespace geofp8
