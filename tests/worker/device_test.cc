// geofp8-worker --device (worker/daemon/device.h): cpu, cuda[:N] against the driver's GPU count,
// and the count itself from a folder standing in for /proc/driver/nvidia/gpus.
#include "worker/daemon/device.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

namespace geofp8::worker {
namespace {

TEST(WorkerDevice, CpuAndCudaParse) {
  auto cpu = ParseWorkerDevice("cpu", 0, "gpus");
  ASSERT_TRUE(cpu.ok());
  EXPECT_EQ(cpu->name, "cpu");
  EXPECT_FALSE(cpu->is_cuda());
  auto cuda = ParseWorkerDevice("cuda", 2, "gpus");
  ASSERT_TRUE(cuda.ok()) << cuda.status();
  EXPECT_EQ(cuda->name, "cuda:0");
  EXPECT_EQ(cuda->cuda_index, 0);
  auto one = ParseWorkerDevice("cuda:1", 2, "gpus");
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->name, "cuda:1");
  EXPECT_EQ(one->cuda_index, 1);
}

TEST(WorkerDevice, AGpuPastTheCountIsRefusedWithBothNumbers) {
  auto r = ParseWorkerDevice("cuda:7", 2, "/proc/driver/nvidia/gpus");
  ASSERT_FALSE(r.ok());
  const std::string m(r.status().message());
  EXPECT_NE(m.find("cuda:7 names GPU 7, but this machine has 2 GPUs (0-1"), std::string::npos) << m;
  EXPECT_NE(m.find("/proc/driver/nvidia/gpus"), std::string::npos) << m;
  EXPECT_FALSE(ParseWorkerDevice("cuda:2", 2, "gpus").ok());  // the first index past the end
  auto none = ParseWorkerDevice("cuda", 0, "gpus");
  ASSERT_FALSE(none.ok());
  EXPECT_NE(std::string(none.status().message()).find("no GPU"), std::string::npos);
}

TEST(WorkerDevice, MalformedValuesAreNamed) {
  for (const char* bad :
       {"gpu", "cuda:", "cuda:-1", "cuda:x", "cuda:1x", "cuda:99999", "CUDA", " cpu", ""}) {
    auto r = ParseWorkerDevice(bad, 8, "gpus");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_NE(std::string(r.status().message()).find("accepted: cpu, cuda, cuda:N"),
              std::string::npos)
        << bad << ": " << r.status();
  }
}

TEST(WorkerDevice, CountsTheDriversEntries) {
  const auto dir =
      std::filesystem::temp_directory_path() /
      ("geofp8-gpus-" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()));
  std::filesystem::remove_all(dir);
  EXPECT_EQ(CountNvidiaGpus(dir.string()), 0);  // no driver
  std::filesystem::create_directories(dir / "0000:3b:00.0");
  std::filesystem::create_directories(dir / "0000:af:00.0");
  EXPECT_EQ(CountNvidiaGpus(dir.string()), 2);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace geofp8::worker
