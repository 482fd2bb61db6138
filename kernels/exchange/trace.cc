// Exchange timeline spans and their Chrome trace JSON (see trace.h).
#include "kernels/exchange/trace.h"

#include <cerrno>
#include <cstring>
#include <fstream>

#include "kernels/common/check.h"

namespace geofp8 {

void ExchangeTrace::Add(const char* name, Lane lane, uint64_t step, int group,
                        Clock::time_point begin, Clock::time_point end) {
  using std::chrono::duration_cast;
  using std::chrono::microseconds;
  Span s;
  s.name = name;
  s.lane = lane;
  s.step = step;
  s.group = group;
  s.begin_us = duration_cast<microseconds>(begin.time_since_epoch()).count();
  s.duration_us = duration_cast<microseconds>(end - begin).count();
  std::lock_guard<std::mutex> lock(mu_);
  if (spans_.size() >= max_spans_) {
    ++dropped_;
    return;
  }
  spans_.push_back(s);
}

std::vector<ExchangeTrace::Span> ExchangeTrace::spans() const {
  std::lock_guard<std::mutex> lock(mu_);
  return spans_;
}

size_t ExchangeTrace::dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

void ExchangeTrace::WriteChromeJson(const std::string& path, int rank) const {
  const std::vector<Span> spans = this->spans();
  std::ofstream out(path, std::ios::trunc);
  GEOFP8_CHECK(out, "trace: cannot write ", path, ": ", std::strerror(errno));
  static const char* const kLaneNames[] = {"exchange (main channel)", "side channel",
                                           "codec helper", "trainer"};
  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
  out << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << rank << ",\"args\":{\"name\":\"rank "
      << rank << "\"}}";
  for (int lane = 0; lane < 4; ++lane) {
    out << ",\n{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << rank << ",\"tid\":" << lane
        << ",\"args\":{\"name\":\"" << kLaneNames[lane] << "\"}}";
  }
  for (const Span& s : spans) {
    out << ",\n{\"name\":\"" << s.name << "\",\"ph\":\"X\",\"pid\":" << rank
        << ",\"tid\":" << static_cast<int>(s.lane) << ",\"ts\":" << s.begin_us
        << ",\"dur\":" << s.duration_us << ",\"args\":{\"step\":" << s.step
        << ",\"group\":" << s.group << "}}";
  }
  out << "\n]}\n";
  out.close();
  GEOFP8_CHECK(out, "trace: writing ", path, " failed: ", std::strerror(errno));
}

}  // namespace geofp8
