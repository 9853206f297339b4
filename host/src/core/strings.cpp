#include "core/strings.h"

#include <sys/ioctl.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
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

std::string FormatByteCount(uint64_t bytes) {
  static const char* const kUnits[] = {"KiB", "MiB", "GiB", "TiB"};
  std::string text = std::to_string(bytes) + " bytes";
  if (bytes >= 1024) {
    double value = static_cast<double>(bytes);
    int unit = -1;
    while (value >= 1024 && unit < 3) {
      value /= 1024;
      ++unit;
    }
    char buf[32];
    std::snprintf(buf, sizeof buf, " (%.2f %s)", value, kUnits[unit]);
    text += buf;
  }
  return text;
}

std::optional<uint64_t> ParseByteSize(std::string_view text) {
  auto trim = [](std::string_view s) {
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
    while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
    return s;
  };
  text = trim(text);
  size_t end = 0;
  while (end < text.size() &&
         (std::isdigit(static_cast<unsigned char>(text[end])) || text[end] == '.')) {
    ++end;
  }
  const std::string number(text.substr(0, end));
  if (number.empty() || number == "." || std::count(number.begin(), number.end(), '.') > 1) {
    return std::nullopt;
  }
  std::string unit(trim(text.substr(end)));
  for (char& c : unit) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  static const std::pair<const char*, int> kUnits[] = {{"", 0},     {"b", 0},    {"kib", 10},
                                                       {"mib", 20}, {"gib", 30}, {"tib", 40}};
  for (const auto& [name, shift] : kUnits) {
    if (unit != name) continue;
    const long double value = std::strtold(number.c_str(), nullptr) * std::ldexp(1.0L, shift);
    // A fraction of a byte is no size, and 2^63 bytes is beyond any machine.
    if (value != std::floor(value) || value >= std::ldexp(1.0L, 63)) return std::nullopt;
    return static_cast<uint64_t>(value);
  }
  return std::nullopt;
}

}  // namespace cai
