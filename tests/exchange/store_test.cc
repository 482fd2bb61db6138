// Tests of the rendezvous stores: set/get/wait/add semantics, timeouts that name the key, the
// gloo adapter, and a store over another's calls (FunctionStore).
#include "kernels/exchange/store.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "kernels/common/check.h"
#include "kernels/exchange/function_store.h"
#include "kernels/exchange/gloo_communicator.h"

namespace geofp8 {
namespace {

using std::chrono::milliseconds;

std::vector<uint8_t> Bytes(const std::string& s) { return {s.begin(), s.end()}; }

void ExerciseStore(Store& store) {
  store.Set("a/b c", Bytes("hello"));
  EXPECT_EQ(store.Get("a/b c", milliseconds(10)), Bytes("hello"));
  store.Set("a/b c", Bytes(""));
  EXPECT_EQ(store.Get("a/b c", milliseconds(10)), Bytes(""));
  EXPECT_EQ(store.Add("counter", 3), 3);
  EXPECT_EQ(store.Add("counter", -5), -2);
  EXPECT_EQ(ParseStoreInt(store.Get("counter", milliseconds(10))), -2);

  // Get waits for a key set later by another thread.
  std::thread writer([&] {
    std::this_thread::sleep_for(milliseconds(50));
    store.Set("late", Bytes("x"));
  });
  EXPECT_EQ(store.Get("late", milliseconds(5000)), Bytes("x"));
  writer.join();

  // A missing key times out with an error naming it.
  try {
    store.Wait({"late", "never"}, milliseconds(30));
    FAIL() << "Wait did not time out";
  } catch (const StoreTimeoutError& e) {  // typed: a poller tells it from other errors by type
    EXPECT_NE(std::string(e.what()).find("'never'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(store.Get("never", milliseconds(10)), StoreTimeoutError);
}

TEST(MemoryStore, SetGetWaitAdd) {
  MemoryStore store;
  ExerciseStore(store);
}

TEST(FileStore, SetGetWaitAdd) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("geofp8_store_test_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  {
    FileStore store(dir.string());
    ExerciseStore(store);
  }
  std::filesystem::remove_all(dir);
}

TEST(FileStore, ConcurrentAddIsAtomic) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("geofp8_store_add_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  FileStore store(dir.string());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < 50; ++i) store.Add("n", 1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ParseStoreInt(store.Get("n", milliseconds(10))), 200);
  std::filesystem::remove_all(dir);
}

// FunctionStore over a MemoryStore's calls, logging them: Get waits before it gets, and a
// failing call's error names the call and keeps the message.
TEST(FunctionStore, ForwardsAndNamesTheFailingCall) {
  MemoryStore inner;
  std::vector<std::string> calls;
  FunctionStore::Calls c;
  c.set = [&](const std::string& k, const std::vector<uint8_t>& v) {
    calls.push_back("set " + k);
    inner.Set(k, v);
  };
  c.get = [&](const std::string& k) {
    calls.push_back("get " + k);
    return inner.Get(k, milliseconds(0));
  };
  c.wait = [&](const std::vector<std::string>& keys, milliseconds t) {
    calls.push_back("wait " + keys[0]);
    inner.Wait(keys, t);
  };
  c.add = [&](const std::string& k, int64_t d) {
    calls.push_back("add " + k);
    return inner.Add(k, d);
  };
  FunctionStore store(c);
  store.Set("k", Bytes("v"));
  EXPECT_EQ(store.Get("k", milliseconds(10)), Bytes("v"));
  EXPECT_EQ(store.Add("n", 2), 2);
  EXPECT_EQ(calls, (std::vector<std::string>{"set k", "wait k", "get k", "add n"}));
  try {
    store.Wait({"never", "k"}, milliseconds(5));
    FAIL() << "Wait did not time out";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("store wait for 'never' (2 keys, timeout 5 ms): ", 0), 0u) << what;
    EXPECT_NE(what.find("'never'", 20), std::string::npos) << what;  // the inner message
  }
  c.set = [](const std::string&, const std::vector<uint8_t>&) {
    throw std::runtime_error("connection reset");
  };
  FunctionStore failing(c);
  try {
    failing.Set("addr/0", Bytes("x"));
    FAIL() << "Set did not fail";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "store set 'addr/0': connection reset");
  }
}

TEST(GlooStoreAdapter, ForwardsToStore) {
  MemoryStore store;
  GlooStoreAdapter adapter(store, milliseconds(20));
  adapter.set("k", {'1', '2'});
  EXPECT_EQ(adapter.get("k"), (std::vector<char>{'1', '2'}));
  adapter.wait({"k"});
  EXPECT_THROW(adapter.get("missing"), Error);
  EXPECT_THROW(adapter.wait({"missing"}, milliseconds(10)), Error);
}

}  // namespace
}  // namespace geofp8
