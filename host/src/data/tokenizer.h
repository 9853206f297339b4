// Byte-level tokenizer: every byte is its own token (ids 0..255), plus optional special tokens
// numbered from 256 in the order given. Needs no vocabulary file, so the default data set
// trains out of the box; vocab_size() is what the model's embedding must hold.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace cai::data {

// Token ids as stored in .bin files (llm.c and nanoGPT both use uint16).
using Token = uint16_t;

class ByteTokenizer {
 public:
  // `specials` are literal strings such as "<|endoftext|>"; they get ids 256, 257, ...
  // Throws cai::Error (INVALID_ARGUMENT) for an empty or duplicate special, or so many that
  // ids would not fit in a Token.
  explicit ByteTokenizer(std::vector<std::string> specials = {});

  int vocab_size() const { return 256 + static_cast<int>(specials_.size()); }

  // One token per byte; special strings in `text` are encoded as their bytes, so untrusted
  // text can never inject a special token.
  std::vector<Token> Encode(std::string_view text) const;

  // Like Encode, but each occurrence of a special string becomes its single id (the longest
  // special wins where two start at the same byte).
  std::vector<Token> EncodeWithSpecials(std::string_view text) const;

  // Bytes back, special ids as their strings. Throws cai::Error (INVALID_ARGUMENT) naming the
  // position and id for an id >= vocab_size().
  std::string Decode(std::span<const Token> tokens) const;

  // The id of a special string; throws cai::Error (NOT_FOUND) if it is not one.
  Token SpecialId(std::string_view special) const;

 private:
  std::vector<std::string> specials_;
};

}  // namespace cai::data
