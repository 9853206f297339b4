// A minimal JSON writer for the run directory's metrics.jsonl and summary.json, and a reader
// for the JSON other tools write (safetensors headers, Hugging Face's config.json).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
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

// A parsed JSON value. Numbers keep their text's integer value when they have one (shapes and
// offsets beyond 2^53 stay exact). Objects keep the last of repeated keys.
struct JsonValue {
  enum class Type { kNull, kBool, kNumber, kString, kArray, kObject };
  Type type = Type::kNull;
  bool boolean = false;
  double number = 0;
  bool is_integer = false;  // the text was an integer that fits int64
  int64_t integer = 0;
  std::string string;
  std::vector<JsonValue> array;
  std::map<std::string, JsonValue, std::less<>> object;

  // The member `key` of an object, or nullptr (also when this is not an object).
  const JsonValue* Find(std::string_view key) const;
};

// Parses `text` (RFC 8259; nesting at most 64 deep). Throws cai::Error INVALID_ARGUMENT naming
// `what` and the byte offset on malformed input.
JsonValue ParseJson(std::string_view text, const std::string& what);

}  // namespace cai
