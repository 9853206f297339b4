#include "loader/config.h"

#include <toml++/toml.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <sstream>

#include "core/status.h"
#include "core/strings.h"

namespace cai {
namespace {

std::string Describe(const toml::node& node) {
  std::ostringstream os;
  switch (node.type()) {
    case toml::node_type::string:
      os << "string \"" << *node.value<std::string>() << '"';
      break;
    case toml::node_type::integer:
      os << "integer " << *node.value<int64_t>();
      break;
    case toml::node_type::floating_point:
      os << "float " << *node.value<double>();
      break;
    case toml::node_type::boolean:
      os << "boolean " << (*node.value<bool>() ? "true" : "false");
      break;
    case toml::node_type::table:
      os << "a table";
      break;
    case toml::node_type::array:
      os << "an array";
      break;
    default:
      os << "a date/time";
      break;
  }
  return os.str();
}

std::string At(const toml::node& node) { return WhereWritten(node); }

std::string Choices(const ConfigKey& key) {
  std::string text;
  for (const auto& c : key.choices) text += (text.empty() ? "\"" : ", \"") + c + "\"";
  return text;
}

// Converts one TOML value to the key's type and checks range and choices.
cai_config::Value Convert(const ConfigKey& key, const toml::node& node, std::string_view where) {
  auto fail = [&](const std::string& what) {
    throw Error(CAI_INVALID_ARGUMENT, std::string(where) + ": key '" + key.name + "'" + At(node) +
                                          ": " + what + ". " + key.doc);
  };
  cai_config::Value v;
  v.type = key.type;
  v.is_default = false;
  switch (key.type) {
    case CAI_CONFIG_BOOL:
      if (!node.is_boolean()) fail("expected a boolean, got " + Describe(node));
      v.b = *node.value<bool>();
      break;
    case CAI_CONFIG_INT:
      if (!node.is_integer()) fail("expected an integer, got " + Describe(node));
      v.i = *node.value<int64_t>();
      v.f = static_cast<double>(v.i);
      break;
    case CAI_CONFIG_FLOAT:
      if (!node.is_number()) fail("expected a number, got " + Describe(node));
      v.f = *node.value<double>();
      break;
    case CAI_CONFIG_STRING:
      if (!node.is_string()) fail("expected a string, got " + Describe(node));
      v.s = *node.value<std::string>();
      if (!key.choices.empty() &&
          std::find(key.choices.begin(), key.choices.end(), v.s) == key.choices.end()) {
        const std::vector<std::string_view> choices(key.choices.begin(), key.choices.end());
        const std::string nearest = NearestKey(v.s, choices);
        fail("\"" + v.s + "\" is not one of " + Choices(key) +
             (nearest.empty() ? "" : " (did you mean \"" + nearest + "\"?)"));
      }
      break;
    default:
      fail("has an unknown type");
  }
  if (key.type == CAI_CONFIG_INT || key.type == CAI_CONFIG_FLOAT) {
    double x = key.type == CAI_CONFIG_INT ? static_cast<double>(v.i) : v.f;
    std::ostringstream bound;
    if (key.has_min && !(x >= key.min_value)) {
      bound << "value " << x << " is below the minimum " << key.min_value;
      fail(bound.str());
    }
    if (key.has_max && !(x <= key.max_value)) {
      bound << "value " << x << " is above the maximum " << key.max_value;
      fail(bound.str());
    }
  }
  return v;
}

cai_config::Value ParseDefault(const ConfigKey& key, std::string_view owner) {
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + key.default_literal);
  } catch (const toml::parse_error&) {
  }
  if (!parsed.get("v")) {
    throw Error(CAI_INVALID_ARGUMENT,
                std::string(owner) + ": config key '" + key.name +
                    "' has a default that is not a TOML value: " + key.default_literal);
  }
  cai_config::Value v = Convert(key, *parsed.get("v"), std::string(owner) + " (schema default)");
  v.is_default = true;
  return v;
}

const cai_config::Value* Find(const cai_config* config, const char* key, const void* out,
                              cai_config_type type, cai_status** error) {
  if (!config || !key || !out) {
    *error = MakeStatus(CAI_INVALID_ARGUMENT, "config_get: config, key and out must not be NULL");
    return nullptr;
  }
  auto it = config->values.find(std::string_view(key));
  if (it == config->values.end()) {
    *error = MakeStatus(CAI_NOT_FOUND, std::string("config key '") + key +
                                           "' is not declared in the plugin's schema");
    return nullptr;
  }
  if (it->second.type != type) {
    *error = MakeStatus(CAI_INVALID_ARGUMENT, std::string("config key '") + key + "' is a " +
                                                  ConfigTypeName(it->second.type) + ", read as a " +
                                                  ConfigTypeName(type));
    return nullptr;
  }
  return &it->second;
}

}  // namespace

std::string WhereWritten(const toml::node& node) {
  const toml::source_region& source = node.source();
  if (source.path && source.path->starts_with(kSetSourcePrefix))
    return " (from " + *source.path + ")";
  return source.begin.line ? " (line " + std::to_string(source.begin.line) + ")" : std::string();
}

const char* ConfigTypeName(cai_config_type type) {
  switch (type) {
    case CAI_CONFIG_BOOL:
      return "bool";
    case CAI_CONFIG_INT:
      return "int";
    case CAI_CONFIG_FLOAT:
      return "float";
    case CAI_CONFIG_STRING:
      return "string";
    default:
      return "unknown type";
  }
}

std::vector<ConfigKey> ReadSchema(const cai_config_key* keys, size_t count,
                                  std::string_view owner) {
  std::vector<ConfigKey> schema;
  if (count == 0) return schema;
  if (!keys) {
    throw Error(CAI_INVALID_ARGUMENT, std::string(owner) + ": num_config_keys is " +
                                          std::to_string(count) + " but config_keys is NULL");
  }
  const size_t stride = keys[0].struct_size;
  constexpr size_t kMinimum = CAI_STRUCT_SIZE(cai_config_key, doc);
  if (stride < kMinimum) {
    throw Error(CAI_INVALID_ARGUMENT, std::string(owner) + ": config key struct_size " +
                                          std::to_string(stride) + " is below ABI 1.0's " +
                                          std::to_string(kMinimum));
  }
  const char* base = reinterpret_cast<const char*>(keys);
  for (size_t i = 0; i < count; ++i) {
    const auto* raw = reinterpret_cast<const cai_config_key*>(base + i * stride);
    ConfigKey key;
    auto bad = [&](const std::string& what) {
      throw Error(CAI_INVALID_ARGUMENT, std::string(owner) + ": config key #" + std::to_string(i) +
                                            " (" + key.name + ") " + what);
    };
    if (!raw->name || !*raw->name) bad("has no name");
    key.name = raw->name;
    for (char c : key.name) {
      if (!(std::islower(static_cast<unsigned char>(c)) ||
            std::isdigit(static_cast<unsigned char>(c)) || c == '_')) {
        bad("has a name outside [a-z0-9_]");
      }
    }
    key.type = raw->type;
    if (key.type < CAI_CONFIG_BOOL || key.type > CAI_CONFIG_STRING) bad("has an unknown type");
    if (!raw->default_value) bad("has no default value");
    key.default_literal = raw->default_value;
    if (!raw->doc || !*raw->doc) bad("has no doc");
    key.doc = raw->doc;
    if (stride >= CAI_STRUCT_SIZE(cai_config_key, choices) && raw->choices) {
      for (const char* const* c = raw->choices; *c; ++c) key.choices.emplace_back(*c);
    }
    if (stride >= CAI_STRUCT_SIZE(cai_config_key, max_value)) {
      key.has_min = raw->flags & CAI_CONFIG_HAS_MIN;
      key.has_max = raw->flags & CAI_CONFIG_HAS_MAX;
      key.min_value = raw->min_value;
      key.max_value = raw->max_value;
    }
    for (const ConfigKey& other : schema) {
      if (other.name == key.name) bad("is declared twice");
    }
    ParseDefault(key, owner);
    schema.push_back(std::move(key));
  }
  return schema;
}

std::unique_ptr<cai_config> ValidateConfig(const std::vector<ConfigKey>& schema,
                                           const toml::table* table, std::string_view where) {
  auto config = std::make_unique<cai_config>();
  std::vector<std::string_view> names;
  for (const ConfigKey& key : schema) names.push_back(key.name);
  if (table) {
    for (const auto& [name, node] : *table) {
      auto it = std::find(names.begin(), names.end(), name.str());
      if (it == names.end()) {
        std::string msg =
            std::string(where) + ": unknown key '" + std::string(name.str()) + "'" + At(node) + ".";
        std::string hint = DidYouMean(name.str(), names);
        msg += hint.empty() ? "" : hint;
        msg += names.empty() ? " This table takes no keys." : " Valid keys: " + Join(names) + ".";
        throw Error(CAI_INVALID_ARGUMENT, msg);
      }
    }
  }
  for (const ConfigKey& key : schema) {
    const toml::node* node = table ? table->get(key.name) : nullptr;
    config->values[key.name] = node ? Convert(key, *node, where) : ParseDefault(key, where);
  }
  return config;
}

cai_status* ConfigGetBool(const cai_config* config, const char* key, bool* out) {
  cai_status* error = nullptr;
  if (const auto* v = Find(config, key, out, CAI_CONFIG_BOOL, &error)) *out = v->b;
  return error;
}

cai_status* ConfigGetInt(const cai_config* config, const char* key, int64_t* out) {
  cai_status* error = nullptr;
  if (const auto* v = Find(config, key, out, CAI_CONFIG_INT, &error)) *out = v->i;
  return error;
}

cai_status* ConfigGetFloat(const cai_config* config, const char* key, double* out) {
  cai_status* error = nullptr;
  if (const auto* v = Find(config, key, out, CAI_CONFIG_FLOAT, &error)) *out = v->f;
  return error;
}

cai_status* ConfigGetString(const cai_config* config, const char* key, const char** out) {
  cai_status* error = nullptr;
  if (const auto* v = Find(config, key, out, CAI_CONFIG_STRING, &error)) *out = v->s.c_str();
  return error;
}

}  // namespace cai
