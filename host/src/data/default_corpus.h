// The built-in training text: a few hundred KB of simple English stories (corpus/stories.txt,
// written by corpus/make_stories.py from a small grammar) compiled into the library, so
// `cai train` with no data.* keys trains a small GPT whose loss visibly falls, offline.
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "data/tokenizer.h"

namespace cai::data {

// The embedded file's bytes; static storage.
std::span<const unsigned char> DefaultCorpusBytes();

inline std::string_view DefaultCorpusText() {
  const auto bytes = DefaultCorpusBytes();
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

// The corpus through ByteTokenizer: one token per byte, vocabulary 256.
std::vector<Token> DefaultCorpusTokens();

}  // namespace cai::data
