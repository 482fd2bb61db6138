// Bounded reads of a rank's output for the coordinator's LogRead (see log_reader.h).
#include "worker/daemon/log_reader.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "worker/daemon/command_runner.h"

namespace geofp8::worker {
namespace {

// Closes the descriptor on every return path.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// pread until `n` bytes or the end; -1 on an error (errno set).
ssize_t ReadAt(int fd, char* buf, size_t n, int64_t offset) {
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd, buf + got, n - got, offset + static_cast<int64_t>(got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -1;
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  return static_cast<ssize_t>(got);
}

// Where the last `lines` lines of a file of `size` bytes start, looking back at most
// kMaxTailScanBytes. A final line without its newline counts as a line.
int64_t TailStart(int fd, int64_t size, int32_t lines, std::string* error) {
  constexpr int64_t kBlock = 64 << 10;
  std::vector<char> buf(kBlock);
  const int64_t floor = std::max<int64_t>(0, size - kMaxTailScanBytes);
  int64_t end = size;
  int32_t seen = 0;
  bool last_byte = true;  // the newline ending the file does not start a line
  while (end > floor) {
    const int64_t begin = std::max(floor, end - kBlock);
    const ssize_t n = ReadAt(fd, buf.data(), static_cast<size_t>(end - begin), begin);
    if (n < 0) {
      *error = std::strerror(errno);
      return -1;
    }
    for (int64_t i = n - 1; i >= 0; --i) {
      if (buf[i] != '\n') {
        last_byte = false;
        continue;
      }
      if (last_byte) {
        last_byte = false;
        continue;
      }
      if (++seen == lines) return begin + i + 1;
    }
    end = begin;
  }
  return floor;
}

}  // namespace

std::string RankLogPath(const std::string& data_dir, const v1::LogRead& request,
                        std::string* error) {
  // The coordinator names jobs by their ids; anything that could leave the jobs folder is refused.
  const std::string& job = request.job_id();
  if (job.empty() || job == "." || job == ".." || job.find('/') != std::string::npos ||
      job.find('\0') != std::string::npos) {
    *error = "job_id: not a job id (" + job + ")";
    return "";
  }
  if (request.attempt() < 0 || request.rank() < 0) {
    *error = "attempt and rank: must be >= 0 (attempt " + std::to_string(request.attempt()) +
             ", rank " + std::to_string(request.rank()) + ")";
    return "";
  }
  const char* suffix = request.stream() == v1::LOG_STDERR ? ".err" : ".out";
  return CommandJobDir(data_dir, job, request.attempt()) + "/rank" +
         std::to_string(request.rank()) + suffix;
}

v1::LogData ReadRankLog(const std::string& data_dir, const v1::LogRead& request) {
  v1::LogData out;
  out.set_request_id(request.request_id());
  std::string error;
  const std::string path = RankLogPath(data_dir, request, &error);
  if (path.empty()) {
    out.set_error(error);
    return out;
  }
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (f.fd < 0) {
    if (errno == ENOENT) {
      out.set_missing(true);
      out.set_eof(true);
    } else {
      out.set_error(path + ": " + std::strerror(errno));
    }
    return out;
  }
  struct stat st {};
  if (::fstat(f.fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    out.set_error(path + ": not a regular file");
    return out;
  }
  const int64_t size = st.st_size;
  int64_t offset = std::clamp<int64_t>(request.offset(), 0, size);
  if (request.tail_lines() > 0) {
    offset = TailStart(f.fd, size, request.tail_lines(), &error);
    if (offset < 0) {
      out.set_error(path + ": " + error);
      return out;
    }
  }
  const int32_t cap = std::clamp<int32_t>(request.max_bytes(), 1, kMaxLogReadBytes);
  const int64_t want = std::min<int64_t>(cap, size - offset);
  std::string data(static_cast<size_t>(want), '\0');
  const ssize_t n = ReadAt(f.fd, data.data(), data.size(), offset);
  if (n < 0) {
    out.set_error(path + ": " + std::strerror(errno));
    return out;
  }
  data.resize(static_cast<size_t>(n));
  out.set_offset(offset);
  out.set_eof(offset + n >= size);
  out.set_data(std::move(data));
  return out;
}

}  // namespace geofp8::worker
