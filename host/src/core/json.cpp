#include "core/json.h"

#include <charconv>

namespace cai {

std::string JsonQuote(std::string_view s) {
  std::string out = "\"";
  for (char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out + "\"";
}

JsonObject& JsonObject::Add(std::string_view key, double value) {
  // JSON has no NaN/Infinity: null keeps the file parseable and says "no value".
  if (!std::isfinite(value)) return AddRaw(key, "null");
  // The shortest text that reads back as the same double, so files compare bit for bit.
  char buf[32];
  auto end = std::to_chars(buf, buf + sizeof buf, value).ptr;
  return AddRaw(key, std::string(buf, end));
}
JsonObject& JsonObject::Add(std::string_view key, int64_t value) {
  return AddRaw(key, std::to_string(value));
}
JsonObject& JsonObject::Add(std::string_view key, uint64_t value) {
  return AddRaw(key, std::to_string(value));
}
JsonObject& JsonObject::Add(std::string_view key, bool value) {
  return AddRaw(key, value ? "true" : "false");
}
JsonObject& JsonObject::Add(std::string_view key, std::string_view value) {
  return AddRaw(key, JsonQuote(value));
}
JsonObject& JsonObject::AddRaw(std::string_view key, std::string raw_json) {
  members_.emplace_back(std::string(key), std::move(raw_json));
  return *this;
}

std::string JsonObject::str() const {
  std::string out = "{";
  for (size_t i = 0; i < members_.size(); ++i) {
    out += (i ? ", " : "") + JsonQuote(members_[i].first) + ": " + members_[i].second;
  }
  return out + "}";
}

std::string JsonArray(const std::vector<std::string>& items) {
  std::string out = "[";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i];
  return out + "]";
}

}  // namespace cai
