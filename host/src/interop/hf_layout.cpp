#include "interop/hf_layout.h"

#include <charconv>
#include <cmath>

#include "core/status.h"

namespace cai::interop {
namespace {

bool IsLlama(const ModelConfig& c) { return c.arch == ModelConfig::Arch::kLlama; }

// The MLP width the zoo builds (zoo.cpp): GPT-2 4 * n_embd, Llama Meta's 8/3 * n_embd rounded
// up to a multiple of 256, unless ffn_hidden says otherwise.
int64_t FfnHidden(const ModelConfig& c) {
  if (c.ffn_hidden != 0) return c.ffn_hidden;
  return IsLlama(c) ? 256 * ((8 * c.n_embd / 3 + 255) / 256) : 4 * c.n_embd;
}
int64_t KvHeads(const ModelConfig& c) { return c.n_kv_head == 0 ? c.n_head : c.n_kv_head; }

// Shortest text that reads back as the same double (500000.0, 0.00001), always with a '.' or
// an exponent, so both JSON and TOML read it as a float.
std::string Float(double v) {
  char buf[64];
  const double a = std::fabs(v);
  const auto format =
      a == 0 || (a >= 1e-7 && a < 1e16) ? std::chars_format::fixed : std::chars_format::scientific;
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, v, format);
  std::string s(buf, end);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

const JsonValue& Field(const JsonValue& config, const char* key, const std::string& what) {
  const JsonValue* v = config.Find(key);
  if (v == nullptr || v->type == JsonValue::Type::kNull) {
    throw Error(CAI_INVALID_ARGUMENT, what + ": no \"" + std::string(key) + "\"");
  }
  return *v;
}
int64_t IntField(const JsonValue& config, const char* key, const std::string& what) {
  const JsonValue& v = Field(config, key, what);
  if (!v.is_integer) {
    throw Error(CAI_INVALID_ARGUMENT, what + ": \"" + std::string(key) + "\" is not an integer");
  }
  return v.integer;
}
double NumberField(const JsonValue& config, const char* key, const std::string& what,
                   double fallback) {
  const JsonValue* v = config.Find(key);
  if (v == nullptr || v->type == JsonValue::Type::kNull) return fallback;
  if (v->type != JsonValue::Type::kNumber) {
    throw Error(CAI_INVALID_ARGUMENT, what + ": \"" + std::string(key) + "\" is not a number");
  }
  return v->number;
}
bool BoolField(const JsonValue& config, const char* key, bool fallback) {
  const JsonValue* v = config.Find(key);
  return v != nullptr && v->type == JsonValue::Type::kBool ? v->boolean : fallback;
}
std::string StringField(const JsonValue& config, const char* key, const std::string& fallback) {
  const JsonValue* v = config.Find(key);
  return v != nullptr && v->type == JsonValue::Type::kString ? v->string : fallback;
}
void RequireUnsupportedAbsent(const JsonValue& config, const char* key, const std::string& what,
                              const std::string& why) {
  const JsonValue* v = config.Find(key);
  if (v != nullptr && v->type != JsonValue::Type::kNull) {
    throw Error(CAI_INVALID_ARGUMENT, what + ": \"" + std::string(key) + "\" is set; " + why);
  }
}
}  // namespace

std::vector<HfTensor> HfLayout(const ModelConfig& c) {
  std::vector<HfTensor> out;
  const int64_t e = c.n_embd, f = FfnHidden(c);
  auto add = [&](std::string hf, std::string cai, std::vector<int64_t> shape, bool t = false) {
    out.push_back({std::move(hf), std::move(cai), std::move(shape), t});
  };
  if (!IsLlama(c)) {
    // Biases HF always has; zeros (cai_name empty) when cai's model has none.
    auto bias = [&](const std::string& hf, const std::string& cai, int64_t n) {
      add(hf + ".bias", c.bias ? cai + ".bias" : std::string(), {n});
    };
    add("transformer.wte.weight", "wte.weight", {c.vocab_size, e});
    add("transformer.wpe.weight", "wpe.weight", {c.n_ctx, e});
    for (int64_t l = 0; l < c.n_layer; ++l) {
      const std::string h = "transformer.h." + std::to_string(l), b = "blocks." + std::to_string(l);
      add(h + ".ln_1.weight", b + ".ln_1.weight", {e});
      bias(h + ".ln_1", b + ".ln_1", e);
      add(h + ".attn.c_attn.weight", b + ".attn.qkv.weight", {e, 3 * e}, true);
      bias(h + ".attn.c_attn", b + ".attn.qkv", 3 * e);
      add(h + ".attn.c_proj.weight", b + ".attn.proj.weight", {e, e}, true);
      bias(h + ".attn.c_proj", b + ".attn.proj", e);
      add(h + ".ln_2.weight", b + ".ln_2.weight", {e});
      bias(h + ".ln_2", b + ".ln_2", e);
      add(h + ".mlp.c_fc.weight", b + ".mlp.fc.weight", {e, f}, true);
      bias(h + ".mlp.c_fc", b + ".mlp.fc", f);
      add(h + ".mlp.c_proj.weight", b + ".mlp.proj.weight", {f, e}, true);
      bias(h + ".mlp.c_proj", b + ".mlp.proj", e);
    }
    add("transformer.ln_f.weight", "ln_f.weight", {e});
    bias("transformer.ln_f", "ln_f", e);
    return out;
  }
  const int64_t kv = KvHeads(c) * (e / c.n_head);
  auto linear = [&](const std::string& hf, const std::string& cai, int64_t rows, int64_t cols) {
    add(hf + ".weight", cai + ".weight", {rows, cols});
    if (c.bias) add(hf + ".bias", cai + ".bias", {rows});
  };
  add("model.embed_tokens.weight", "embed_tokens.weight", {c.vocab_size, e});
  for (int64_t l = 0; l < c.n_layer; ++l) {
    const std::string h = "model.layers." + std::to_string(l), b = "blocks." + std::to_string(l);
    add(h + ".input_layernorm.weight", b + ".attn_norm.weight", {e});
    linear(h + ".self_attn.q_proj", b + ".attn.q", e, e);
    linear(h + ".self_attn.k_proj", b + ".attn.k", kv, e);
    linear(h + ".self_attn.v_proj", b + ".attn.v", kv, e);
    linear(h + ".self_attn.o_proj", b + ".attn.o", e, e);
    add(h + ".post_attention_layernorm.weight", b + ".mlp_norm.weight", {e});
    linear(h + ".mlp.gate_proj", b + ".mlp.gate", f, e);
    linear(h + ".mlp.up_proj", b + ".mlp.up", f, e);
    linear(h + ".mlp.down_proj", b + ".mlp.down", e, f);
  }
  add("model.norm.weight", "norm.weight", {e});
  add("lm_head.weight", "lm_head.weight", {c.vocab_size, e});
  return out;
}

std::string HfConfigJson(const ModelConfig& c, const std::string& torch_dtype) {
  JsonObject j;
  if (!IsLlama(c)) {
    j.AddRaw("architectures", JsonArray({JsonQuote("GPT2LMHeadModel")}));
    j.Add("model_type", "gpt2");
    j.Add("vocab_size", c.vocab_size);
    j.Add("n_positions", c.n_ctx);
    j.Add("n_ctx", c.n_ctx);
    j.Add("n_embd", c.n_embd);
    j.Add("n_layer", c.n_layer);
    j.Add("n_head", c.n_head);
    j.Add("n_inner", FfnHidden(c));
    j.Add("activation_function", "gelu_new");  // tanh-approximated GELU, as cai computes
    j.AddRaw("layer_norm_epsilon", Float(c.norm_eps));
    j.AddRaw("initializer_range", Float(c.init_std));
    j.AddRaw("resid_pdrop", "0.0");
    j.AddRaw("embd_pdrop", "0.0");
    j.AddRaw("attn_pdrop", "0.0");
    j.Add("scale_attn_weights", true);
    j.Add("tie_word_embeddings", true);
  } else {
    j.AddRaw("architectures", JsonArray({JsonQuote("LlamaForCausalLM")}));
    j.Add("model_type", "llama");
    j.Add("vocab_size", c.vocab_size);
    j.Add("hidden_size", c.n_embd);
    j.Add("intermediate_size", FfnHidden(c));
    j.Add("num_hidden_layers", c.n_layer);
    j.Add("num_attention_heads", c.n_head);
    j.Add("num_key_value_heads", KvHeads(c));
    j.Add("head_dim", c.n_embd / c.n_head);
    j.Add("max_position_embeddings", c.n_ctx);
    j.AddRaw("rms_norm_eps", Float(c.norm_eps));
    j.AddRaw("rope_theta", Float(c.rope_theta));
    j.AddRaw("rope_scaling", "null");
    j.Add("hidden_act", "silu");
    j.Add("attention_bias", c.bias);
    j.Add("mlp_bias", c.bias);
    j.AddRaw("attention_dropout", "0.0");
    j.AddRaw("initializer_range", Float(c.init_std));
    j.Add("tie_word_embeddings", false);
  }
  j.Add("torch_dtype", torch_dtype);
  return j.str() + "\n";
}

ModelConfig ModelConfigFromHf(const JsonValue& j, const std::string& what) {
  if (j.type != JsonValue::Type::kObject) {
    throw Error(CAI_INVALID_ARGUMENT, what + ": not a JSON object");
  }
  const std::string type = StringField(j, "model_type", "");
  ModelConfig c;
  if (type == "gpt2") {
    c.arch = ModelConfig::Arch::kGpt2;
    c.vocab_size = IntField(j, "vocab_size", what);
    c.n_ctx = IntField(j, "n_positions", what);
    c.n_embd = IntField(j, "n_embd", what);
    c.n_layer = IntField(j, "n_layer", what);
    c.n_head = IntField(j, "n_head", what);
    const JsonValue* inner = j.Find("n_inner");
    c.ffn_hidden = inner != nullptr && inner->is_integer ? inner->integer : 4 * c.n_embd;
    c.norm_eps = NumberField(j, "layer_norm_epsilon", what, 1e-5);
    c.init_std = NumberField(j, "initializer_range", what, 0.02);
    c.bias = true;
    const std::string act = StringField(j, "activation_function", "gelu_new");
    if (act != "gelu_new" && act != "gelu_pytorch_tanh") {
      throw Error(CAI_INVALID_ARGUMENT, what + ": activation_function \"" + act +
                                            "\"; cai's GPT-2 computes the tanh GELU "
                                            "(gelu_new)");
    }
    if (!BoolField(j, "scale_attn_weights", true) ||
        BoolField(j, "scale_attn_by_inverse_layer_idx", false) ||
        BoolField(j, "reorder_and_upcast_attn", false)) {
      throw Error(CAI_INVALID_ARGUMENT,
                  what +
                      ": attention scaled otherwise than by 1/sqrt(head size), which cai's "
                      "GPT-2 does not compute");
    }
    if (!BoolField(j, "tie_word_embeddings", true)) {
      throw Error(CAI_INVALID_ARGUMENT,
                  what + ": tie_word_embeddings is false; cai's GPT-2 ties lm_head to wte");
    }
  } else if (type == "llama") {
    c.arch = ModelConfig::Arch::kLlama;
    c.vocab_size = IntField(j, "vocab_size", what);
    c.n_ctx = IntField(j, "max_position_embeddings", what);
    c.n_embd = IntField(j, "hidden_size", what);
    c.n_layer = IntField(j, "num_hidden_layers", what);
    c.n_head = IntField(j, "num_attention_heads", what);
    const JsonValue* kv = j.Find("num_key_value_heads");
    c.n_kv_head = kv != nullptr && kv->is_integer ? kv->integer : c.n_head;
    c.ffn_hidden = IntField(j, "intermediate_size", what);
    c.norm_eps = NumberField(j, "rms_norm_eps", what, 1e-6);
    c.rope_theta = NumberField(j, "rope_theta", what, 10000.0);
    c.init_std = NumberField(j, "initializer_range", what, 0.02);
    c.bias = BoolField(j, "attention_bias", false);
    if (BoolField(j, "mlp_bias", false) != c.bias) {
      throw Error(CAI_INVALID_ARGUMENT, what +
                                            ": attention_bias and mlp_bias differ; cai's Llama "
                                            "has biases in every projection or in none");
    }
    RequireUnsupportedAbsent(j, "rope_scaling", what,
                             "cai's Llama computes plain rotary embeddings (no scaling)");
    if (const JsonValue* hd = j.Find("head_dim");
        hd != nullptr && hd->is_integer && c.n_head > 0 && hd->integer * c.n_head != c.n_embd) {
      throw Error(CAI_INVALID_ARGUMENT,
                  what +
                      ": head_dim * num_attention_heads != hidden_size, which cai's Llama "
                      "requires");
    }
    const std::string act = StringField(j, "hidden_act", "silu");
    if (act != "silu") {
      throw Error(CAI_INVALID_ARGUMENT,
                  what + ": hidden_act \"" + act + "\"; cai's Llama computes SwiGLU (silu)");
    }
  } else {
    throw Error(CAI_INVALID_ARGUMENT, what + ": model_type \"" + type +
                                          "\"; cai reads gpt2 (GPT2LMHeadModel) and llama "
                                          "(LlamaForCausalLM)");
  }
  return c;
}

std::string ModelKeysToml(const ModelConfig& c) {
  std::string s;
  auto line = [&](const char* key, const std::string& value) {
    s += std::string(key) + " = " + value + "\n";
  };
  line("kind", IsLlama(c) ? "\"llama\"" : "\"gpt2\"");
  line("vocab_size", std::to_string(c.vocab_size));
  line("n_ctx", std::to_string(c.n_ctx));
  line("n_layer", std::to_string(c.n_layer));
  line("n_head", std::to_string(c.n_head));
  if (IsLlama(c)) line("n_kv_head", std::to_string(KvHeads(c)));
  line("n_embd", std::to_string(c.n_embd));
  line("ffn_hidden", std::to_string(FfnHidden(c)));
  line("bias", c.bias ? "true" : "false");
  line("norm_eps", Float(c.norm_eps));
  if (IsLlama(c)) line("rope_theta", Float(c.rope_theta));
  line("init_std", Float(c.init_std));
  return s;
}

std::vector<std::string> ConfigDifferences(const ModelConfig& job, const ModelConfig& saved) {
  std::vector<std::string> out;
  auto diff = [&](const char* key, const std::string& a, const std::string& b) {
    if (a != b) out.push_back(std::string("model.") + key + " = " + a + " (saved: " + b + ")");
  };
  auto kind = [](const ModelConfig& c) { return IsLlama(c) ? "llama" : "gpt2"; };
  diff("kind", kind(job), kind(saved));
  diff("vocab_size", std::to_string(job.vocab_size), std::to_string(saved.vocab_size));
  diff("n_ctx", std::to_string(job.n_ctx), std::to_string(saved.n_ctx));
  diff("n_layer", std::to_string(job.n_layer), std::to_string(saved.n_layer));
  diff("n_head", std::to_string(job.n_head), std::to_string(saved.n_head));
  diff("n_kv_head", std::to_string(KvHeads(job)), std::to_string(KvHeads(saved)));
  diff("n_embd", std::to_string(job.n_embd), std::to_string(saved.n_embd));
  diff("ffn_hidden", std::to_string(FfnHidden(job)), std::to_string(FfnHidden(saved)));
  diff("norm_eps", Float(job.norm_eps), Float(saved.norm_eps));
  if (IsLlama(job) && IsLlama(saved)) {
    diff("bias", job.bias ? "true" : "false", saved.bias ? "true" : "false");
    diff("rope_theta", Float(job.rope_theta), Float(saved.rope_theta));
  }
  return out;
}

}  // namespace cai::interop
