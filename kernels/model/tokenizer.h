// Byte-level tokenizer: every byte of UTF-8 text is one token in [0, 256). Lossless both ways.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace geofp8::model {

class ByteTokenizer {
 public:
  static constexpr int kVocab = 256;
  static std::vector<int32_t> Encode(std::string_view text) {
    std::vector<int32_t> out(text.size());
    for (size_t i = 0; i < text.size(); ++i) out[i] = static_cast<unsigned char>(text[i]);
    return out;
  }
  // Tokens outside [0, 256) are a caller bug; they are written as '?'.
  static std::string Decode(std::span<const int32_t> tokens) {
    std::string out(tokens.size(), '?');
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (tokens[i] >= 0 && tokens[i] < kVocab) out[i] = static_cast<char>(tokens[i]);
    }
    return out;
  }
};

// True when bytes are well-formed UTF-8 (no overlongs, no surrogates, <= U+10FFFF).
bool IsValidUtf8(std::string_view bytes);

}  // namespace geofp8::model
