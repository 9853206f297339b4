// Small string helpers shared by every place that reports a bad name to the user.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace cai {

// Edit distance between two strings: insertions, deletions, substitutions and swaps of two
// neighbouring characters each count 1 (optimal string alignment).
size_t EditDistance(std::string_view a, std::string_view b);

// The candidate closest to `key` by edit distance, or "" if none is close enough to be a
// plausible typo (distance at most max(2, |key|/3)).
std::string NearestKey(std::string_view key, std::span<const std::string_view> candidates);

// " did you mean 'x'?" or "" — appended to "unknown key" messages.
std::string DidYouMean(std::string_view key, std::span<const std::string_view> candidates);

// Joins with ", ".
std::string Join(std::span<const std::string_view> items);

// Terminal columns `text` takes: one per UTF-8 code point (what cai prints has no wide or
// combining characters).
size_t Columns(std::string_view text);

// `text` cut to at most `columns` columns at a code point boundary.
std::string_view FitColumns(std::string_view text, size_t columns);

// "123 bytes", or "3145728 bytes (3.00 MiB)" from 1 KiB up: the exact count and a readable one.
std::string FormatByteCount(uint64_t bytes);

// A size as users write one: a whole number of bytes ("1048576"), or a number with a binary
// unit ("512MiB", "1.5 GiB"; B, KiB, MiB, GiB, TiB, case-insensitive). nullopt for anything
// else, decimal units (GB) included, which are easy to mistake for binary ones.
std::optional<uint64_t> ParseByteSize(std::string_view text);

// The width of the terminal `fd` refers to, or 0 if it is not a terminal or does not say.
int TerminalColumns(int fd);

}  // namespace cai
