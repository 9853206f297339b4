// A minimal JSON writer for the run directory's metrics.jsonl and summary.json.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

namespace cai {

std::string JsonQuote(std::string_view s);

// Members in insertion order; values are written as given.
class JsonObject {
 public:
  JsonObject& Add(std::string_view key, double value);
  JsonObject& Add(std::string_view key, int64_t value);
  JsonObject& Add(std::string_view key, int value) { return Add(key, int64_t{value}); }
  JsonObject& Add(std::string_view key, uint64_t value);
  JsonObject& Add(std::string_view key, bool value);
  JsonObject& Add(std::string_view key, std::string_view value);
  JsonObject& Add(std::string_view key, const char* value) {
    return Add(key, std::string_view(value));
  }
  JsonObject& AddRaw(std::string_view key, std::string raw_json);
  std::string str() const;

 private:
  std::vector<std::pair<std::string, std::string>> members_;
};

// "[a, b, ...]" of already-formatted JSON values.
std::string JsonArray(const std::vector<std::string>& items);

}  // namespace cai
