// Rendezvous key-value store used by the communicators: set, get, wait with a timeout, add.
// Tests use the in-memory or file store; the coordinator later provides one over gRPC.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/common/check.h"

namespace geofp8 {

// What Get and Wait throw when their timeout runs out (a key that never came). A caller that polls
// tells it from other failures by its type, never by the message text.
class StoreTimeoutError : public Error {
 public:
  using Error::Error;
};

class Store {
 public:
  virtual ~Store() = default;

  // Stores value under key, replacing any previous value.
  virtual void Set(const std::string& key, const std::vector<uint8_t>& value) = 0;

  // Returns the value of key, waiting up to timeout for it to appear. Throws StoreTimeoutError
  // naming the key on timeout.
  virtual std::vector<uint8_t> Get(const std::string& key, std::chrono::milliseconds timeout) = 0;

  // Waits until every key exists. Throws StoreTimeoutError naming the first missing key on
  // timeout.
  virtual void Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;

  // Atomically adds delta to the integer stored under key (0 if absent) and returns the result.
  virtual int64_t Add(const std::string& key, int64_t delta) = 0;
};

// Thread-safe store in process memory: ranks as threads share one instance.
class MemoryStore final : public Store {
 public:
  void Set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> Get(const std::string& key, std::chrono::milliseconds timeout) override;
  void Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  int64_t Add(const std::string& key, int64_t delta) override;

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::vector<uint8_t>> values_;
};

// Store in a shared directory: ranks as processes on one host (or over a shared file system).
// Each key is one file, written to a temporary name and renamed so readers never see a partial
// value; Add serializes through an flock on a lock file.
class FileStore final : public Store {
 public:
  // Creates the directory if it does not exist. Throws geofp8::Error if it cannot.
  explicit FileStore(std::string directory);

  void Set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> Get(const std::string& key, std::chrono::milliseconds timeout) override;
  void Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  int64_t Add(const std::string& key, int64_t delta) override;

 private:
  std::string PathOf(const std::string& key) const;
  bool TryRead(const std::string& key, std::vector<uint8_t>* value) const;

  std::string directory_;
};

// Encodes an integer the way Add stores it (decimal text), so Get can read counters back.
int64_t ParseStoreInt(const std::vector<uint8_t>& value);

}  // namespace geofp8

// GEOFP8_FAIL_STORE_TIMEOUT(...): GEOFP8_FAIL, as a StoreTimeoutError.
#define GEOFP8_FAIL_STORE_TIMEOUT(...) \
  ::geofp8::detail::ThrowError<::geofp8::StoreTimeoutError>(__FILE__, __LINE__, __VA_ARGS__)
