// Data sources: the Markov chain's entropy rate against an empirical estimate, disjoint rank
// shards, the held-out split, text files and folders, the tokenizer round trip.

#include "kernels/model/data.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "kernels/common/check.h"
#include "kernels/model/tokenizer.h"

namespace geofp8::model {
namespace {

namespace fs = std::filesystem;

TEST(Data, TokenizerRoundTripsBytes) {
  const std::string text = "h\xc3\xa9llo \xe2\x82\xac\n";
  const auto tokens = ByteTokenizer::Encode(text);
  EXPECT_EQ(tokens.size(), text.size());
  EXPECT_EQ(tokens[1], 0xc3);
  EXPECT_EQ(ByteTokenizer::Decode(tokens), text);
  EXPECT_TRUE(IsValidUtf8(text));
  EXPECT_FALSE(IsValidUtf8("\xc3"));
  EXPECT_FALSE(IsValidUtf8("\xc0\xaf"));      // overlong
  EXPECT_FALSE(IsValidUtf8("\xed\xa0\x80"));  // surrogate
  EXPECT_FALSE(IsValidUtf8("\xff"));
}

TEST(Data, MarkovEntropyRateMatchesTheEmpiricalConditionalEntropy) {
  MarkovSource src(MarkovOptions{.seed = 5, .alphabet = 8, .successors = 3});
  const double H = src.EntropyBound();
  EXPECT_GT(H, 0.1);
  EXPECT_LT(H, std::log(3.0) + 1e-12);
  // Empirical -mean log P(x_{t+1} | x_t) over many transitions converges to H.
  std::vector<int32_t> batch;
  double nll = 0;
  int64_t n = 0;
  std::vector<double> first(8, 0);
  for (int step = 0; step < 200; ++step) {
    src.TrainBatch(step, 0, 1, 16, 32, &batch);
    for (int b = 0; b < 16; ++b) {
      first[batch[b * 33] - 'a'] += 1;
      for (int t = 0; t < 32; ++t) {
        const int i = batch[b * 33 + t] - 'a', j = batch[b * 33 + t + 1] - 'a';
        const double p = src.transition()[i * 8 + j];
        ASSERT_GT(p, 0.0);
        nll -= std::log(p);
        ++n;
      }
    }
  }
  EXPECT_NEAR(nll / n, H, 0.02);
  // Sequences start from the stationary law.
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(first[i] / 3200.0, src.stationary()[i], 0.03);
}

TEST(Data, MarkovRanksAreDisjointAndMatchTheCombinedBatch) {
  MarkovSource src(MarkovOptions{.seed = 2});
  std::vector<int32_t> combined, part;
  src.TrainBatch(3, 0, 1, 8, 16, &combined);
  std::set<std::vector<int32_t>> rows;
  for (int r = 0; r < 4; ++r) {
    src.TrainBatch(3, r, 4, 2, 16, &part);
    EXPECT_TRUE(std::equal(part.begin(), part.end(), combined.begin() + r * 2 * 17));
    for (int b = 0; b < 2; ++b) rows.insert({part.begin() + b * 17, part.begin() + (b + 1) * 17});
  }
  EXPECT_EQ(rows.size(), 8u);
  std::vector<int32_t> val, val2, next;
  src.ValidationBatch(0, 8, 16, &val);
  src.ValidationBatch(0, 8, 16, &val2);
  EXPECT_EQ(val, val2);
  EXPECT_NE(val, combined);
  src.TrainBatch(4, 0, 1, 8, 16, &next);
  EXPECT_NE(next, combined);
}

class TextDataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("geofp8_text_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) +
            "_" + ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_ / "sub");
  }
  void TearDown() override { fs::remove_all(dir_); }
  void Write(const fs::path& p, const std::string& s) { std::ofstream(dir_ / p) << s; }
  fs::path dir_;
};

TEST_F(TextDataTest, ShardsAreDisjointAndValidationIsHeldOut) {
  std::string text;
  for (int i = 0; i < 1000; ++i) text += char('A' + i % 26);
  Write("a.txt", text);
  TextSource src(TextOptions{.path = (dir_ / "a.txt").string(), .validation_fraction = 0.2});
  EXPECT_EQ(src.train_bytes(), 800u);
  EXPECT_EQ(src.validation_bytes(), 200u);
  // Each rank's windows come from its own quarter of the first 800 bytes: check via positions
  // by encoding the position into the text.
  std::string pos_text(1000, ' ');
  for (int i = 0; i < 1000; ++i) pos_text[i] = char(33 + (i / 10) % 90);
  Write("b.txt", pos_text);
  TextSource pos(TextOptions{.path = (dir_ / "b.txt").string(), .validation_fraction = 0.2});
  std::vector<int32_t> batch;
  for (int r = 0; r < 4; ++r) {
    for (int step = 0; step < 20; ++step) {
      pos.TrainBatch(step, r, 4, 4, 9, &batch);
      for (int32_t t : batch) {
        const int block = t - 33;  // position / 10 within [0, 80)
        EXPECT_GE(block, r * 20);
        EXPECT_LT(block, (r + 1) * 20);
      }
    }
  }
  pos.ValidationBatch(0, 4, 9, &batch);
  for (int32_t t : batch) EXPECT_GE(t - 33, 80);
}

TEST_F(TextDataTest, FolderSkipsNonUtf8FilesAndBadInputsAreNamed) {
  Write("sub/one.txt", std::string(300, 'x'));
  Write("two.txt", std::string(300, 'y'));
  Write("bin.dat", std::string("\xff\xfe\x00\x01", 4));
  TextSource src(TextOptions{.path = dir_.string()});
  EXPECT_EQ(src.files(), 2);
  EXPECT_EQ(src.train_bytes() + src.validation_bytes(), 602u);
  try {
    TextSource bad(TextOptions{.path = (dir_ / "bin.dat").string()});
    FAIL();
  } catch (const geofp8::Error& e) {
    EXPECT_NE(std::string(e.what()).find("not valid UTF-8"), std::string::npos);
  }
  EXPECT_THROW(TextSource(TextOptions{.path = (dir_ / "missing").string()}), geofp8::Error);
  EXPECT_THROW(TextSource(TextOptions{.path = dir_.string(), .validation_fraction = 1.5}),
               geofp8::Error);
  std::vector<int32_t> batch;
  EXPECT_THROW(src.TrainBatch(0, 0, 64, 1, 32, &batch), geofp8::Error);  // shards too small
  auto markov = MakeDataSource("markov:7", 1);
  EXPECT_GT(markov->EntropyBound(), 0);
  EXPECT_TRUE(std::isnan(MakeDataSource(dir_.string(), 1)->EntropyBound()));
  EXPECT_THROW(MakeDataSource("markov:x", 1), geofp8::Error);
}

}  // namespace
}  // namespace geofp8::model
