#include "data/default_corpus.h"

namespace cai::data {

std::vector<Token> DefaultCorpusTokens() { return ByteTokenizer().Encode(DefaultCorpusText()); }

}  // namespace cai::data
