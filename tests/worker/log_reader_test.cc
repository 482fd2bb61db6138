// The worker's answer to a LogRead (worker/daemon/log_reader.h): bounded reads of a rank's output
// file, the tail's start, a file not there yet, and job ids that could leave the jobs folder.
#include "worker/daemon/log_reader.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "worker/daemon/command_runner.h"

namespace geofp8::worker {
namespace {

class LogReaderTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("log_reader_test." + std::to_string(::getpid()) + "." +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(CommandJobDir(dir_, "j-1", 2));
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void Write(const std::string& name, const std::string& text) {
    std::ofstream(CommandJobDir(dir_, "j-1", 2) + "/" + name, std::ios::binary) << text;
  }
  v1::LogRead Read(int64_t offset, int32_t max_bytes, int32_t tail = 0) {
    v1::LogRead r;
    r.set_request_id(7);
    r.set_job_id("j-1");
    r.set_attempt(2);
    r.set_rank(1);
    r.set_offset(offset);
    r.set_max_bytes(max_bytes);
    r.set_tail_lines(tail);
    return r;
  }
  std::string dir_;
};

TEST_F(LogReaderTest, ReadsAtMostTheCapFromTheOffset) {
  const std::string text(200'000, 'a');
  Write("rank1.out", text);
  v1::LogData d = ReadRankLog(dir_, Read(10, 1 << 30));
  EXPECT_EQ(d.request_id(), 7u);
  EXPECT_EQ(d.offset(), 10);
  EXPECT_EQ(d.data().size(), static_cast<size_t>(kMaxLogReadBytes));  // the worker's cap
  EXPECT_FALSE(d.eof());
  d = ReadRankLog(dir_, Read(200'000 - 5, 100));
  EXPECT_EQ(d.data(), "aaaaa");
  EXPECT_TRUE(d.eof());
  d = ReadRankLog(dir_, Read(300'000, 100));  // past the end: at the end, nothing
  EXPECT_EQ(d.offset(), 200'000);
  EXPECT_EQ(d.data(), "");
  EXPECT_TRUE(d.eof());
}

TEST_F(LogReaderTest, TailStartsAtTheLastLines) {
  Write("rank1.out", "one\ntwo\nthree\nfour\n");
  EXPECT_EQ(ReadRankLog(dir_, Read(0, 100, 2)).data(), "three\nfour\n");
  EXPECT_EQ(ReadRankLog(dir_, Read(0, 100, 9)).data(), "one\ntwo\nthree\nfour\n");
  Write("rank1.out", "one\ntwo\npartial");  // a last line without its newline counts
  v1::LogData d = ReadRankLog(dir_, Read(0, 100, 2));
  EXPECT_EQ(d.data(), "two\npartial");
  EXPECT_EQ(d.offset(), 4);
  // Lines longer than one scan block are found across blocks.
  const std::string long_line(100'000, 'x');
  Write("rank1.out", "a\n" + long_line + "\nb\n");
  d = ReadRankLog(dir_, Read(0, 1 << 20, 2));
  EXPECT_EQ(d.offset(), 2);
  EXPECT_EQ(d.data().size(), static_cast<size_t>(kMaxLogReadBytes));
}

TEST_F(LogReaderTest, StderrAndMissingFiles) {
  Write("rank1.err", "warning\n");
  v1::LogRead r = Read(0, 100);
  v1::LogData d = ReadRankLog(dir_, r);
  EXPECT_TRUE(d.missing());  // no rank1.out yet
  EXPECT_TRUE(d.error().empty());
  r.set_stream(v1::LOG_STDERR);
  EXPECT_EQ(ReadRankLog(dir_, r).data(), "warning\n");
}

TEST_F(LogReaderTest, RefusesJobIdsThatLeaveTheJobsFolder) {
  std::filesystem::create_directories(dir_ + "/jobs/x/2");
  for (const std::string bad : {"", ".", "..", "../jobs/j-1", "j-1/../j-1"}) {
    v1::LogRead r = Read(0, 100);
    r.set_job_id(bad);
    v1::LogData d = ReadRankLog(dir_, r);
    EXPECT_NE(d.error().find("job_id: not a job id"), std::string::npos) << bad;
    EXPECT_EQ(d.data(), "") << bad;
  }
  v1::LogRead r = Read(0, 100);
  r.set_rank(-1);
  EXPECT_NE(ReadRankLog(dir_, r).error().find("must be >= 0"), std::string::npos);
  // A symlink planted as the output file is not followed.
  std::filesystem::create_symlink("/etc/passwd", CommandJobDir(dir_, "j-1", 2) + "/rank1.out");
  v1::LogData d = ReadRankLog(dir_, Read(0, 100));
  EXPECT_FALSE(d.error().empty());
  EXPECT_EQ(d.data(), "");
}

}  // namespace
}  // namespace geofp8::worker
