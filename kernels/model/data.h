// Training data for the trainer: a seeded synthetic Markov source with a known entropy rate, and
// UTF-8 text files or folders. Each rank reads a disjoint shard; a held-out split gives validation.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace geofp8::model {

// Batches are `batch` rows of seq+1 byte tokens (inputs plus the shifted targets), row-major.
class DataSource {
 public:
  virtual ~DataSource() = default;
  // Training batch of `rank` out of `ranks` at `step`. Ranks never share a training sequence.
  virtual void TrainBatch(int64_t step, int rank, int ranks, int batch, int seq,
                          std::vector<int32_t>* out) const = 0;
  // Validation batch number `index` from the held-out split; identical on every rank.
  virtual void ValidationBatch(int64_t index, int batch, int seq,
                               std::vector<int32_t>* out) const = 0;
  virtual std::string Describe() const = 0;
  // Lowest achievable mean cross-entropy in nats per token, or NaN when unknown.
  virtual double EntropyBound() const;
};

// Options of the synthetic source. Plain struct with defaults.
struct MarkovOptions {
  uint64_t seed = 1;
  int alphabet = 16;   // symbols, written as the bytes 'a', 'b', ... (<= 94 printable)
  int successors = 4;  // nonzero transitions per state, with random weights
};

// A stationary order-1 Markov chain over `alphabet` bytes. Sequence g of the training stream is a
// pure function of (seed, g): the global sequence index at (step, rank, row) is
// (step * ranks + rank) * batch + row, so N ranks with batch b see exactly the sequences one rank
// with batch N*b sees. Validation sequences come from a disjoint index range.
class MarkovSource : public DataSource {
 public:
  explicit MarkovSource(const MarkovOptions& options);
  void TrainBatch(int64_t step, int rank, int ranks, int batch, int seq,
                  std::vector<int32_t>* out) const override;
  void ValidationBatch(int64_t index, int batch, int seq, std::vector<int32_t>* out) const override;
  std::string Describe() const override;
  // Entropy rate H = -sum_i pi_i sum_j P_ij log P_ij (nats), with pi the stationary law. Every
  // prediction has at least one token of context, so this is the exact optimum of the loss.
  double EntropyBound() const override { return entropy_rate_; }

  const std::vector<double>& transition() const { return P_; }  // alphabet x alphabet
  const std::vector<double>& stationary() const { return pi_; }

 private:
  void Sequence(uint64_t index, int length, int32_t* out) const;
  MarkovOptions options_;
  std::vector<double> P_, pi_, cdf_, pi_cdf_;
  double entropy_rate_ = 0;
};

// Options of the text source. Plain struct with defaults.
struct TextOptions {
  std::string path;                  // a UTF-8 file, or a folder read recursively in sorted order
  double validation_fraction = 0.1;  // the last part of the corpus is held out
  uint64_t seed = 1;                 // window positions
  int64_t max_bytes = 64 << 20;      // stop reading a folder after this many bytes
};

// Windows of seq+1 bytes at seeded random offsets. The training part is cut into `ranks`
// contiguous shards and rank r only reads shard r. In a folder, files that are not valid UTF-8
// are skipped; a single file that is not valid UTF-8 is an error.
class TextSource : public DataSource {
 public:
  explicit TextSource(const TextOptions& options);  // throws geofp8::Error naming the path
  void TrainBatch(int64_t step, int rank, int ranks, int batch, int seq,
                  std::vector<int32_t>* out) const override;
  void ValidationBatch(int64_t index, int batch, int seq, std::vector<int32_t>* out) const override;
  std::string Describe() const override;
  size_t train_bytes() const { return train_end_; }
  size_t validation_bytes() const { return text_.size() - train_end_; }
  int files() const { return files_; }

 private:
  TextOptions options_;
  std::string text_;
  size_t train_end_ = 0;
  int files_ = 0;
};

// Builds a source from a --data argument: "synthetic" / "markov" / "markov:SEED" for the
// synthetic chain, else a path. Throws geofp8::Error naming the value.
std::unique_ptr<DataSource> MakeDataSource(const std::string& spec, uint64_t seed);

}  // namespace geofp8::model
