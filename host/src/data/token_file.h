// Token files in the two layouts the GPT-2 training community shares:
//  - nanoGPT: a bare array of little-endian uint16 token ids (train.bin / val.bin);
//  - llm.c: a 1024-byte header of 256 little-endian int32 (magic 20240520, version 1,
//    token count, then zeros) followed by the same uint16 array.
// The layout is detected by the magic. A raw file whose first two tokens are 56920, 308 would
// read as llm.c; neither id exists in any 16-bit vocabulary below 56921 (GPT-2 has 50257).
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>

#include "data/tokenizer.h"

namespace cai::data {

enum class TokenFileLayout { kRawUint16, kLlmc };

inline constexpr int32_t kLlmcMagic = 20240520;
inline constexpr int32_t kLlmcVersion = 1;
inline constexpr size_t kLlmcHeaderBytes = 256 * sizeof(int32_t);

// A read-only memory map of a validated token file. Move-only; the span lives as long as the
// object. Thread-safe to read.
class TokenFile {
 public:
  // Maps `path` and checks every id against `vocab_size`. Throws cai::Error naming the file:
  // NOT_FOUND if it does not exist; DATA_LOSS for an odd byte length (with the size), a bad
  // llm.c header, or an id >= vocab_size (with the token index, byte offset and id).
  static TokenFile Open(const std::filesystem::path& path, int vocab_size);

  TokenFile(TokenFile&& other) noexcept;
  TokenFile& operator=(TokenFile&& other) noexcept;
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  ~TokenFile();

  std::span<const Token> tokens() const { return tokens_; }
  TokenFileLayout layout() const { return layout_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  TokenFile() = default;
  void Unmap();

  std::filesystem::path path_;
  TokenFileLayout layout_ = TokenFileLayout::kRawUint16;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  std::span<const Token> tokens_;
};

// Writes `tokens` to `path` in `layout` (replacing the file). Throws cai::Error naming the
// path when it cannot be written.
void WriteTokenFile(const std::filesystem::path& path, std::span<const Token> tokens,
                    TokenFileLayout layout);

}  // namespace cai::data
