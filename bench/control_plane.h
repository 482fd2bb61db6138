// Shared by the coordinator benches (coordinator_bench.cc in process, cluster_bench.cc against
// the daemon): latency percentiles and the same-run SQLite commit baseline.
#pragma once

#include <sqlite3.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

namespace geofp8::bench {

using SteadyClock = std::chrono::steady_clock;

inline double Ms(SteadyClock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

// Nearest-rank percentile (p in [0, 1]); 0 for no samples.
inline double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

// Fsync-bound commit rate of the SQLite settings the coordinator's store uses (WAL,
// synchronous=FULL; server/coordinator/store.cc), one small insert per transaction, in a file
// under `dir`: the durability ceiling of anything that commits once per request. 0 when the file
// cannot be opened.
inline double SqliteCommitsPerSecond(const std::string& dir, double seconds) {
  sqlite3* db = nullptr;
  const std::string path = dir + "/baseline.db";
  if (sqlite3_open(path.c_str(), &db) != SQLITE_OK) {
    sqlite3_close(db);
    return 0;
  }
  sqlite3_exec(db,
               "PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;"
               "CREATE TABLE IF NOT EXISTS t(k INTEGER PRIMARY KEY, v BLOB)",
               nullptr, nullptr, nullptr);
  const auto start = SteadyClock::now();
  int n = 0;
  while (std::chrono::duration<double>(SteadyClock::now() - start).count() < seconds) {
    sqlite3_exec(db, "INSERT INTO t(v) VALUES(randomblob(200))", nullptr, nullptr, nullptr);
    ++n;
  }
  const double rate = n / std::chrono::duration<double>(SteadyClock::now() - start).count();
  sqlite3_close(db);
  return rate;
}

}  // namespace geofp8::bench
