// In-memory and file-backed rendezvous stores (see store.h).
#include "kernels/exchange/store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <thread>

#include "kernels/common/check.h"

namespace geofp8 {

int64_t ParseStoreInt(const std::vector<uint8_t>& value) {
  if (value.empty()) return 0;
  const std::string text(value.begin(), value.end());
  size_t used = 0;
  int64_t v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    GEOFP8_FAIL("store: counter value is not an integer (", text, ")");
  }
  GEOFP8_CHECK(used == text.size(), "store: counter value is not an integer (", text, ")");
  return v;
}

namespace {
std::vector<uint8_t> IntBytes(int64_t v) {
  const std::string s = std::to_string(v);
  return std::vector<uint8_t>(s.begin(), s.end());
}
}  // namespace

// ---- MemoryStore ----

void MemoryStore::Set(const std::string& key, const std::vector<uint8_t>& value) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    values_[key] = value;
  }
  cv_.notify_all();
}

std::vector<uint8_t> MemoryStore::Get(const std::string& key, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const bool found =
      cv_.wait_for(lock, timeout, [&] { return values_.find(key) != values_.end(); });
  if (!found)
    GEOFP8_FAIL_STORE_TIMEOUT("store: timed out after ", timeout.count(), " ms waiting for key '",
                              key, "'");
  return values_.at(key);
}

void MemoryStore::Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  const std::string* missing = nullptr;
  const bool found = cv_.wait_for(lock, timeout, [&] {
    for (const auto& k : keys) {
      if (values_.find(k) == values_.end()) {
        missing = &k;
        return false;
      }
    }
    return true;
  });
  if (!found) {
    GEOFP8_FAIL_STORE_TIMEOUT("store: timed out after ", timeout.count(), " ms waiting for key '",
                              *missing, "'");
  }
}

int64_t MemoryStore::Add(const std::string& key, int64_t delta) {
  int64_t result = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = values_.find(key);
    result = (it == values_.end() ? 0 : ParseStoreInt(it->second)) + delta;
    values_[key] = IntBytes(result);
  }
  cv_.notify_all();
  return result;
}

// ---- FileStore ----

FileStore::FileStore(std::string directory) : directory_(std::move(directory)) {
  std::error_code ec;
  std::filesystem::create_directories(directory_, ec);
  GEOFP8_CHECK(!ec && std::filesystem::is_directory(directory_), "store: cannot create directory '",
               directory_, "': ", ec.message());
}

std::string FileStore::PathOf(const std::string& key) const {
  // Keys may hold '/' and other characters a file name cannot: escape everything but [A-Za-z0-9_-].
  std::string name;
  static const char* kHex = "0123456789abcdef";
  for (unsigned char c : key) {
    if (std::isalnum(c) || c == '_' || c == '-') {
      name += static_cast<char>(c);
    } else {
      name += '.';
      name += kHex[c >> 4];
      name += kHex[c & 15];
    }
  }
  return directory_ + "/" + name;
}

bool FileStore::TryRead(const std::string& key, std::vector<uint8_t>* value) const {
  std::ifstream in(PathOf(key), std::ios::binary);
  if (!in) return false;
  value->assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return true;
}

void FileStore::Set(const std::string& key, const std::vector<uint8_t>& value) {
  const std::string path = PathOf(key);
  // The temporary name is unique per process and thread so concurrent writers never collide.
  const std::string tmp = path + ".tmp" + std::to_string(::getpid()) + "_" +
                          std::to_string(std::hash<std::thread::id>()(std::this_thread::get_id()));
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    GEOFP8_CHECK(out.good(), "store: cannot write '", tmp, "': ", std::strerror(errno));
    out.write(reinterpret_cast<const char*>(value.data()),
              static_cast<std::streamsize>(value.size()));
    GEOFP8_CHECK(out.good(), "store: cannot write '", tmp, "': ", std::strerror(errno));
  }
  GEOFP8_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, "store: cannot rename '", tmp, "' to '",
               path, "': ", std::strerror(errno));
}

std::vector<uint8_t> FileStore::Get(const std::string& key, std::chrono::milliseconds timeout) {
  Wait({key}, timeout);
  std::vector<uint8_t> value;
  GEOFP8_CHECK(TryRead(key, &value), "store: key '", key, "' vanished from '", directory_, "'");
  return value;
}

void FileStore::Wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (const auto& key : keys) {
    const std::string path = PathOf(key);
    auto sleep = std::chrono::microseconds(200);
    while (::access(path.c_str(), F_OK) != 0) {
      if (std::chrono::steady_clock::now() >= deadline) {
        GEOFP8_FAIL_STORE_TIMEOUT("store: timed out after ", timeout.count(),
                                  " ms waiting for key '", key, "' in '", directory_, "'");
      }
      std::this_thread::sleep_for(sleep);
      sleep = std::min(sleep * 2, std::chrono::microseconds(20000));
    }
  }
}

int64_t FileStore::Add(const std::string& key, int64_t delta) {
  const std::string lock_path = directory_ + "/.lock";
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT, 0644);
  GEOFP8_CHECK(fd >= 0, "store: cannot open '", lock_path, "': ", std::strerror(errno));
  struct Closer {
    int fd;
    ~Closer() {
      ::flock(fd, LOCK_UN);
      ::close(fd);
    }
  } closer{fd};
  GEOFP8_CHECK(::flock(fd, LOCK_EX) == 0, "store: cannot lock '", lock_path,
               "': ", std::strerror(errno));
  std::vector<uint8_t> value;
  const int64_t result = (TryRead(key, &value) ? ParseStoreInt(value) : 0) + delta;
  Set(key, IntBytes(result));
  return result;
}

}  // namespace geofp8
