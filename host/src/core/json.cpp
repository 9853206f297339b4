#include "core/json.h"

#include <charconv>
#include <cstdlib>

#include "core/status.h"

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

// ---- Reading ------------------------------------------------------------------------------

const JsonValue* JsonValue::Find(std::string_view key) const {
  if (type != Type::kObject) return nullptr;
  const auto it = object.find(key);
  return it == object.end() ? nullptr : &it->second;
}

namespace {

class JsonParser {
 public:
  JsonParser(std::string_view text, const std::string& what) : text_(text), what_(what) {}

  JsonValue Document() {
    JsonValue v = Value(0);
    Space();
    if (pos_ != text_.size()) Fail("unexpected text after the value");
    return v;
  }

 private:
  [[noreturn]] void Fail(const std::string& message) const {
    throw Error(CAI_INVALID_ARGUMENT,
                what_ + ": malformed JSON at byte " + std::to_string(pos_) + ": " + message);
  }
  void Space() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\t' ||
                                   text_[pos_] == '\n' || text_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool Eat(char c) {
    Space();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void Expect(char c) {
    if (!Eat(c)) Fail(std::string("expected '") + c + "'");
  }
  bool Word(std::string_view w) {
    if (text_.substr(pos_, w.size()) != w) return false;
    pos_ += w.size();
    return true;
  }

  JsonValue Value(int depth) {
    if (depth > 64) Fail("nested more than 64 deep");
    Space();
    if (pos_ >= text_.size()) Fail("unexpected end");
    JsonValue v;
    const char c = text_[pos_];
    if (c == '{') {
      ++pos_;
      v.type = JsonValue::Type::kObject;
      if (Eat('}')) return v;
      do {
        Space();
        if (pos_ >= text_.size() || text_[pos_] != '"') Fail("expected a member name");
        std::string key = String();
        Expect(':');
        v.object.insert_or_assign(std::move(key), Value(depth + 1));
      } while (Eat(','));
      Expect('}');
    } else if (c == '[') {
      ++pos_;
      v.type = JsonValue::Type::kArray;
      if (Eat(']')) return v;
      do {
        v.array.push_back(Value(depth + 1));
      } while (Eat(','));
      Expect(']');
    } else if (c == '"') {
      v.type = JsonValue::Type::kString;
      v.string = String();
    } else if (Word("true") || Word("false")) {
      v.type = JsonValue::Type::kBool;
      v.boolean = c == 't';
    } else if (Word("null")) {
      v.type = JsonValue::Type::kNull;
    } else {
      Number(v);
    }
    return v;
  }

  void Number(JsonValue& v) {
    const size_t begin = pos_;
    if (pos_ < text_.size() && text_[pos_] == '-') ++pos_;
    bool integer = true;
    auto digits = [&] {
      const size_t start = pos_;
      while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
      if (pos_ == start) Fail("expected a value");
    };
    digits();
    if (pos_ < text_.size() && text_[pos_] == '.') {
      ++pos_;
      integer = false;
      digits();
    }
    if (pos_ < text_.size() && (text_[pos_] == 'e' || text_[pos_] == 'E')) {
      ++pos_;
      integer = false;
      if (pos_ < text_.size() && (text_[pos_] == '+' || text_[pos_] == '-')) ++pos_;
      digits();
    }
    const std::string token(text_.substr(begin, pos_ - begin));
    v.type = JsonValue::Type::kNumber;
    v.number = std::strtod(token.c_str(), nullptr);
    if (integer) {
      const auto [end, ec] = std::from_chars(token.data(), token.data() + token.size(), v.integer);
      v.is_integer = ec == std::errc() && end == token.data() + token.size();
    }
  }

  void Utf8(std::string& out, uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xE0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  uint32_t Hex4() {
    if (pos_ + 4 > text_.size()) Fail("short \\u escape");
    uint32_t cp = 0;
    const auto [end, ec] = std::from_chars(text_.data() + pos_, text_.data() + pos_ + 4, cp, 16);
    if (ec != std::errc() || end != text_.data() + pos_ + 4) Fail("bad \\u escape");
    pos_ += 4;
    return cp;
  }

  std::string String() {
    ++pos_;  // the opening quote
    std::string out;
    while (true) {
      if (pos_ >= text_.size()) Fail("unterminated string");
      const char c = text_[pos_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) Fail("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (pos_ >= text_.size()) Fail("unterminated string");
      const char e = text_[pos_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out += e;
          break;
        case 'b':
          out += '\b';
          break;
        case 'f':
          out += '\f';
          break;
        case 'n':
          out += '\n';
          break;
        case 'r':
          out += '\r';
          break;
        case 't':
          out += '\t';
          break;
        case 'u': {
          uint32_t cp = Hex4();
          if (cp >= 0xD800 && cp < 0xDC00 && Word("\\u")) {
            const uint32_t low = Hex4();
            if (low < 0xDC00 || low > 0xDFFF) Fail("bad surrogate pair");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
          }
          Utf8(out, cp);
          break;
        }
        default:
          Fail(std::string("bad escape '\\") + e + "'");
      }
    }
  }

  std::string_view text_;
  const std::string& what_;
  size_t pos_ = 0;
};

}  // namespace

JsonValue ParseJson(std::string_view text, const std::string& what) {
  return JsonParser(text, what).Document();
}

}  // namespace cai
