#include "data/default_corpus.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace cai::data {
namespace {

TEST(DefaultCorpus, IsHundredsOfKilobytesOfPlainEnglishStories) {
  const std::string_view text = DefaultCorpusText();
  EXPECT_GT(text.size(), 200u * 1024);
  EXPECT_LT(text.size(), 1024u * 1024);
  EXPECT_TRUE(text.starts_with("One windy morning, Jack the fox went to the market"));
  EXPECT_TRUE(std::all_of(text.begin(), text.end(),
                          [](char c) { return c == '\n' || (c >= ' ' && c <= '~'); }));
  EXPECT_GT(std::count(text.begin(), text.end(), '\n'), 1000);
}

TEST(DefaultCorpus, TokensAreItsBytes) {
  const std::vector<Token> tokens = DefaultCorpusTokens();
  const std::string_view text = DefaultCorpusText();
  ASSERT_EQ(tokens.size(), text.size());
  EXPECT_EQ(tokens[0], 'O');
  EXPECT_EQ(ByteTokenizer().Decode(tokens), text);
}

}  // namespace
}  // namespace cai::data
