#include "core/strings.h"

#include <sys/ioctl.h>

#include <algorithm>
#include <vector>

namespace cai {

size_t EditDistance(std::string_view a, std::string_view b) {
  // Optimal string alignment (Damerau-Levenshtein without repeated edits of a substring): two
  // neighbours typed in the wrong order ("fdsp" for "fsdp", "stpes") are one edit, not two.
  std::vector<size_t> before(b.size() + 1), above(b.size() + 1), row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    before.swap(above);
    above.swap(row);
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      row[j] =
          std::min({above[j] + 1, row[j - 1] + 1, above[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        row[j] = std::min(row[j], before[j - 2] + 1);
      }
    }
  }
  return row[b.size()];
}

std::string NearestKey(std::string_view key, std::span<const std::string_view> candidates) {
  std::string_view best;
  size_t best_distance = std::max<size_t>(2, key.size() / 3) + 1;
  for (std::string_view candidate : candidates) {
    size_t d = EditDistance(key, candidate);
    // A key that is a prefix of a valid one ("bucket_cap" for "bucket_cap_mb") is a typo too.
    if (candidate.starts_with(key) || key.starts_with(candidate)) d = std::min<size_t>(d, 1);
    if (d < best_distance) {
      best_distance = d;
      best = candidate;
    }
  }
  return std::string(best);
}

std::string DidYouMean(std::string_view key, std::span<const std::string_view> candidates) {
  std::string nearest = NearestKey(key, candidates);
  return nearest.empty() ? std::string() : " did you mean '" + nearest + "'?";
}

std::string Join(std::span<const std::string_view> items) {
  std::string out;
  for (std::string_view item : items) {
    if (!out.empty()) out += ", ";
    out += item;
  }
  return out;
}

size_t Columns(std::string_view text) {
  size_t n = 0;
  for (char c : text) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

std::string_view FitColumns(std::string_view text, size_t columns) {
  size_t seen = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) continue;
    if (seen++ == columns) return text.substr(0, i);
  }
  return text;
}

int TerminalColumns(int fd) {
  winsize size{};
  if (::ioctl(fd, TIOCGWINSZ, &size) != 0) return 0;
  return size.ws_col;
}

}  // namespace cai
