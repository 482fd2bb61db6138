// A rendezvous store over another one's four calls, as a language binding hands them over
// (geofp8.torch: torch's c10d store), with errors that name the call.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "kernels/exchange/store.h"

namespace geofp8 {

// Get waits for the key before it gets, as such stores' get blocks with their own timeout. An
// exception from a call (any) becomes a geofp8::Error naming the call, its key and timeout,
// and keeping its message: "store wait for 'k' (2 keys, timeout 300 ms): <message>".
class FunctionStore final : public Store {
 public:
  struct Calls {
    std::function<void(const std::string& key, const std::vector<uint8_t>& value)> set;
    std::function<std::vector<uint8_t>(const std::string& key)> get;
    std::function<void(const std::vector<std::string>& keys, std::chrono::milliseconds)> wait;
    std::function<int64_t(const std::string& key, int64_t delta)> add;
  };
  explicit FunctionStore(Calls calls) : calls_(std::move(calls)) {}

  void Set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> Get(const std::string& key, std::chrono::milliseconds timeout) override;
  void Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  int64_t Add(const std::string& key, int64_t delta) override;

 private:
  Calls calls_;
};

}  // namespace geofp8
