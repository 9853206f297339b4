#include "data/tokenizer.h"

#include <gtest/gtest.h>

#include "core/status.h"

namespace cai::data {
namespace {

TEST(ByteTokenizer, EncodeThenDecode_RoundTripsEveryByteValue) {
  std::string text;
  for (int b = 0; b < 256; ++b) text.push_back(static_cast<char>(b));
  text += "héllo, wörld";
  const ByteTokenizer tokenizer;
  const std::vector<Token> tokens = tokenizer.Encode(text);
  ASSERT_EQ(tokens.size(), text.size());
  EXPECT_EQ(tokens[0], 0);
  EXPECT_EQ(tokens[255], 255);
  EXPECT_EQ(tokens[256], 'h');
  EXPECT_EQ(tokenizer.Decode(tokens), text);
  EXPECT_EQ(tokenizer.vocab_size(), 256);
}

TEST(ByteTokenizer, Specials_GetIdsFrom256AndEncodeOnlyWhenAsked) {
  const ByteTokenizer tokenizer({"<|endoftext|>", "<|pad|>"});
  EXPECT_EQ(tokenizer.vocab_size(), 258);
  EXPECT_EQ(tokenizer.SpecialId("<|endoftext|>"), 256);
  EXPECT_EQ(tokenizer.SpecialId("<|pad|>"), 257);

  const std::string text = "a<|endoftext|>b";
  EXPECT_EQ(tokenizer.Encode(text).size(), text.size());
  const std::vector<Token> with = tokenizer.EncodeWithSpecials(text);
  EXPECT_EQ(with, (std::vector<Token>{'a', 256, 'b'}));
  EXPECT_EQ(tokenizer.Decode(with), text);
}

TEST(ByteTokenizer, DecodeIdOutsideVocabulary_NamesPositionAndId) {
  const ByteTokenizer tokenizer;
  const std::vector<Token> tokens{'o', 'k', 300};
  try {
    tokenizer.Decode(tokens);
    FAIL() << "decoded an id outside the vocabulary";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("token 300 at position 2"), std::string::npos) << e.what();
  }
}

TEST(ByteTokenizer, DuplicateOrEmptySpecial_IsRejected) {
  EXPECT_THROW(ByteTokenizer({"<a>", "<a>"}), Error);
  EXPECT_THROW(ByteTokenizer({""}), Error);
  EXPECT_THROW(ByteTokenizer().SpecialId("<|endoftext|>"), Error);
}

}  // namespace
}  // namespace cai::data
