#include "data/tokenizer.h"

#include <limits>

#include "core/status.h"

namespace cai::data {

ByteTokenizer::ByteTokenizer(std::vector<std::string> specials) : specials_(std::move(specials)) {
  if (specials_.size() > std::numeric_limits<Token>::max() + 1u - 256u) {
    throw Error(CAI_INVALID_ARGUMENT, "too many special tokens (" +
                                          std::to_string(specials_.size()) +
                                          "): ids must fit in 16 bits");
  }
  for (size_t i = 0; i < specials_.size(); ++i) {
    if (specials_[i].empty()) {
      throw Error(CAI_INVALID_ARGUMENT, "special token " + std::to_string(i) + " is empty");
    }
    for (size_t j = 0; j < i; ++j) {
      if (specials_[i] == specials_[j]) {
        throw Error(CAI_INVALID_ARGUMENT, "special token '" + specials_[i] + "' is listed twice");
      }
    }
  }
}

std::vector<Token> ByteTokenizer::Encode(std::string_view text) const {
  std::vector<Token> tokens;
  tokens.reserve(text.size());
  for (char c : text) tokens.push_back(static_cast<unsigned char>(c));
  return tokens;
}

std::vector<Token> ByteTokenizer::EncodeWithSpecials(std::string_view text) const {
  std::vector<Token> tokens;
  tokens.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    size_t best = specials_.size();
    for (size_t s = 0; s < specials_.size(); ++s) {
      if (text.substr(i).starts_with(specials_[s]) &&
          (best == specials_.size() || specials_[s].size() > specials_[best].size())) {
        best = s;
      }
    }
    if (best < specials_.size()) {
      tokens.push_back(static_cast<Token>(256 + best));
      i += specials_[best].size();
    } else {
      tokens.push_back(static_cast<unsigned char>(text[i]));
      ++i;
    }
  }
  return tokens;
}

std::string ByteTokenizer::Decode(std::span<const Token> tokens) const {
  std::string text;
  text.reserve(tokens.size());
  for (size_t i = 0; i < tokens.size(); ++i) {
    const Token id = tokens[i];
    if (id < 256) {
      text.push_back(static_cast<char>(id));
    } else if (id < vocab_size()) {
      text += specials_[id - 256];
    } else {
      throw Error(CAI_INVALID_ARGUMENT, "cannot decode token " + std::to_string(id) +
                                            " at position " + std::to_string(i) +
                                            ": the byte tokenizer's vocabulary has " +
                                            std::to_string(vocab_size()) + " ids");
    }
  }
  return text;
}

Token ByteTokenizer::SpecialId(std::string_view special) const {
  for (size_t s = 0; s < specials_.size(); ++s) {
    if (specials_[s] == special) return static_cast<Token>(256 + s);
  }
  throw Error(CAI_NOT_FOUND, "'" + std::string(special) + "' is not a special token");
}

}  // namespace cai::data
