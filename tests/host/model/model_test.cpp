// The model service through its C++ class and its ABI table, without LibTorch: tensors are
// read and written through cai_tensor descriptors as a plugin would.
#include "model/model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <string>
#include <vector>

#include "core/status.h"

namespace cai {
namespace {

// Host memory with a descriptor over it.
template <class T>
struct HostTensor {
  std::vector<T> data;
  std::vector<int64_t> shape, strides;
  cai_dtype dtype;

  HostTensor(std::vector<int64_t> s, cai_dtype d) : shape(std::move(s)), dtype(d) {
    int64_t n = 1;
    strides.resize(shape.size());
    for (size_t i = shape.size(); i-- > 0;) {
      strides[i] = n;
      n *= shape[i];
    }
    data.assign(n, T{});
  }
  cai_tensor desc() {
    return {data.data(),
            {CAI_DEVICE_CPU, 0},
            int32_t(shape.size()),
            dtype,
            shape.data(),
            strides.data(),
            0};
  }
};

constexpr cai_dtype kF32{CAI_DTYPE_FLOAT, 32, 1};
constexpr cai_dtype kI64{CAI_DTYPE_INT, 64, 1};

// A descriptor of `numel` floats at `data` (a slice of a flat buffer).
struct FlatView {
  int64_t shape[1], strides[1] = {1};
  cai_tensor desc(float* data, int64_t numel) {
    shape[0] = numel;
    return {data, {CAI_DEVICE_CPU, 0}, 1, kF32, shape, strides, 0};
  }
};

ModelConfig Gpt2Config() {
  ModelConfig c;
  c.arch = ModelConfig::Arch::kGpt2;
  c.vocab_size = 64;
  c.n_ctx = 16;
  c.n_layer = 2;
  c.n_head = 2;
  c.n_embd = 32;
  return c;
}

ModelConfig LlamaConfig() {
  ModelConfig c;
  c.arch = ModelConfig::Arch::kLlama;
  c.vocab_size = 64;
  c.n_ctx = 16;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.n_embd = 32;
  c.ffn_hidden = 48;
  c.bias = false;
  return c;
}

// A fixed batch [2, 8]: next-token targets of a repeating pattern, the last one ignored.
struct Batch {
  HostTensor<int64_t> tokens{{2, 8}, kI64}, targets{{2, 8}, kI64};
  Batch() {
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t t = 0; t < 8; ++t) {
        tokens.data[b * 8 + t] = (b * 13 + t * 5) % 40;
        targets.data[b * 8 + t] = t == 7 ? -1 : (b * 13 + (t + 1) * 5) % 40;
      }
    }
  }
};

std::vector<float> Floats(const cai_tensor& t) {
  int64_t n = 1;
  for (int32_t i = 0; i < t.ndim; ++i) n *= t.shape[i];
  const float* p = reinterpret_cast<const float*>(static_cast<const char*>(t.data) + t.byte_offset);
  return std::vector<float>(p, p + n);
}

std::vector<std::vector<float>> Weights(Model& m) {
  std::vector<std::vector<float>> out;
  for (uint32_t i = 0; i < m.NumParams(); ++i) out.push_back(Floats(m.ParamData(i)));
  return out;
}

std::vector<std::vector<float>> Grads(Model& m) {
  std::vector<std::vector<float>> out;
  for (uint32_t i = 0; i < m.NumParams(); ++i) out.push_back(Floats(m.ParamGrad(i)));
  return out;
}

void SgdStep(Model& m, float lr) {
  for (uint32_t i = 0; i < m.NumParams(); ++i) {
    cai_tensor p = m.ParamData(i);
    const std::vector<float> g = Floats(m.ParamGrad(i));
    auto* w = static_cast<float*>(p.data);
    for (size_t k = 0; k < g.size(); ++k) w[k] -= lr * g[k];
  }
  m.ZeroGrad(true);
}

double MaxAbsDiff(const std::vector<std::vector<float>>& a,
                  const std::vector<std::vector<float>>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    for (size_t k = 0; k < a[i].size(); ++k) {
      worst = std::max(worst, std::abs(double(a[i][k]) - double(b[i][k])));
    }
  }
  return worst;
}

int64_t TotalNumel(Model& m) {
  int64_t n = 0;
  for (uint32_t i = 0; i < m.NumParams(); ++i) n += m.ParamInfo(i).numel;
  return n;
}

// ---- Zoo -----------------------------------------------------------------------------------

TEST(Zoo, SameSeed_BitIdenticalWeights_DifferentSeedDiffers) {
  for (ModelConfig c : {Gpt2Config(), LlamaConfig()}) {
    auto a = MakeZooModel(c, 1234), b = MakeZooModel(c, 1234), other = MakeZooModel(c, 1235);
    const auto wa = Weights(*a), wb = Weights(*b), wo = Weights(*other);
    for (size_t i = 0; i < wa.size(); ++i) {
      ASSERT_EQ(0, std::memcmp(wa[i].data(), wb[i].data(), wa[i].size() * sizeof(float)))
          << a->ParamInfo(i).name;
    }
    EXPECT_NE(wa[0], wo[0]);  // the token embedding is random in both
  }
}

TEST(Zoo, Gpt2_Metadata_NamesShapesGroupsRolesUnits) {
  auto m = MakeZooModel(Gpt2Config(), 1);
  ASSERT_EQ(m->NumUnits(), 4u);  // embedding, 2 blocks, head
  EXPECT_STREQ(m->UnitInfo(0).name, "embedding");
  EXPECT_EQ(m->UnitInfo(1).kind, CAI_UNIT_BLOCK);
  EXPECT_STREQ(m->UnitInfo(2).name, "blocks.1");
  EXPECT_EQ(m->UnitInfo(3).kind, CAI_UNIT_HEAD);
  // Only the head reads a parameter another unit holds: the tied token embedding.
  for (uint32_t u = 0; u < 3; ++u) EXPECT_EQ(m->UnitInfo(u).num_reads, 0u) << u;
  const cai_unit_info head = m->UnitInfo(3);
  ASSERT_EQ(head.num_reads, 1u);
  EXPECT_EQ(head.reads[0], 0u);
  EXPECT_STREQ(m->ParamInfo(head.reads[0]).name, "wte.weight");
  // wte, wpe + 12 per block + ln_f weight and bias.
  ASSERT_EQ(m->NumParams(), 2u + 2 * 12 + 2);
  std::set<std::string> names;
  int64_t unit_numel = 0;
  for (uint32_t u = 0; u < m->NumUnits(); ++u) unit_numel += m->UnitInfo(u).numel;
  for (uint32_t i = 0; i < m->NumParams(); ++i) {
    cai_param_info p = m->ParamInfo(i);
    names.insert(p.name);
    EXPECT_EQ(p.group, p.ndim >= 2 ? 0u : 1u) << p.name;
    EXPECT_EQ(p.tied_to, -1);
    EXPECT_TRUE(p.flags & CAI_PARAM_REQUIRES_GRAD);
  }
  EXPECT_EQ(names.size(), m->NumParams());
  EXPECT_EQ(unit_numel, TotalNumel(*m));
  cai_param_info qkv = m->ParamInfo(4);
  EXPECT_STREQ(qkv.name, "blocks.0.attn.qkv.weight");
  EXPECT_STREQ(qkv.module_path, "blocks.0.attn.qkv");
  EXPECT_EQ(std::vector<int64_t>(qkv.shape, qkv.shape + qkv.ndim), (std::vector<int64_t>{96, 32}));
  EXPECT_EQ(qkv.role, CAI_ROLE_ATTN_QKV);
  EXPECT_EQ(qkv.parallel_dim, 0);
  EXPECT_EQ(qkv.unit, 1);
  cai_param_info qkv_bias = m->ParamInfo(5);
  EXPECT_TRUE(qkv_bias.flags & CAI_PARAM_IS_BIAS);
  cai_param_info proj = m->ParamInfo(6);
  EXPECT_STREQ(proj.name, "blocks.0.attn.proj.weight");
  EXPECT_EQ(proj.role, CAI_ROLE_ATTN_OUT);
  EXPECT_EQ(proj.parallel_dim, 1);
  EXPECT_EQ(m->NumBuffers(), 0u);
}

TEST(Zoo, Llama_Metadata_GroupedQueryShapes) {
  auto m = MakeZooModel(LlamaConfig(), 1);
  // embed + 9 per block (2 norms; q, k, v, o; gate, up, down) + norm + lm_head.
  ASSERT_EQ(m->NumParams(), 1u + 2 * 9 + 2);
  cai_param_info k = m->ParamInfo(3);
  EXPECT_STREQ(k.name, "blocks.0.attn.k.weight");
  EXPECT_EQ(std::vector<int64_t>(k.shape, k.shape + k.ndim), (std::vector<int64_t>{16, 32}));
  cai_param_info head = m->ParamInfo(m->NumParams() - 1);
  EXPECT_STREQ(head.name, "lm_head.weight");
  EXPECT_EQ(head.role, CAI_ROLE_LM_HEAD);
  EXPECT_EQ(head.unit, 3);
  for (uint32_t u = 0; u < m->NumUnits(); ++u) EXPECT_EQ(m->UnitInfo(u).num_reads, 0u) << u;
  EXPECT_EQ(m->NumBuffers(), 0u);  // RoPE tables are not state
}

TEST(Zoo, BadConfig_IsRejectedNamingTheField) {
  ModelConfig c = Gpt2Config();
  c.n_embd = 30;
  c.n_head = 4;
  try {
    MakeZooModel(c, 1);
    FAIL() << "accepted n_embd 30 with 4 heads";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("n_embd (30) must be a multiple of n_head (4)"),
              std::string::npos);
  }
}

TEST(Zoo, ForwardShapes_HiddenStatesPerStage) {
  for (ModelConfig c : {Gpt2Config(), LlamaConfig()}) {
    auto m = MakeZooModel(c, 3);
    Batch batch;
    cai_tensor tokens = batch.tokens.desc();
    Model::StageResult r = m->StageForward(0, 2, &tokens, nullptr, nullptr);
    cai_tensor h = Model::ActivationData(*r.output);
    EXPECT_EQ(std::vector<int64_t>(h.shape, h.shape + h.ndim), (std::vector<int64_t>{2, 8, 32}));
    EXPECT_EQ(h.dtype.code, CAI_DTYPE_FLOAT);
  }
}

TEST(Zoo, InitialLoss_IsNearLnVocab) {
  for (ModelConfig c : {Gpt2Config(), LlamaConfig()}) {
    auto m = MakeZooModel(c, 5);
    Batch batch;
    const double loss = m->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), false);
    EXPECT_NEAR(loss, std::log(64.0), 0.05) << m->Describe();
  }
}

TEST(Zoo, SgdSteps_ReduceLossOnFixedBatch) {
  for (ModelConfig c : {Gpt2Config(), LlamaConfig()}) {
    auto m = MakeZooModel(c, 9);
    Batch batch;
    std::vector<double> losses;
    for (int step = 0; step < 10; ++step) {
      losses.push_back(m->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true));
      SgdStep(*m, 0.1f);
    }
    // Plain SGD may overshoot once in a while later on; the first steps must all descend.
    for (size_t i = 1; i < 5; ++i) EXPECT_LT(losses[i], losses[i - 1]) << i;
    EXPECT_LT(losses.back(), losses.front() - 1.0) << m->Describe();
  }
}

// ---- Tied embedding --------------------------------------------------------------------------

TEST(Gpt2, TiedEmbedding_ExposedOnceAndGetsGradientFromBothUses) {
  auto full = MakeZooModel(Gpt2Config(), 11), staged = MakeZooModel(Gpt2Config(), 11);
  cai_param_info wte = full->ParamInfo(0);
  EXPECT_STREQ(wte.name, "wte.weight");
  EXPECT_EQ(wte.role, CAI_ROLE_EMBEDDING);
  EXPECT_EQ(wte.unit, 0);
  for (uint32_t i = 0; i < full->NumParams(); ++i) {
    EXPECT_EQ(std::string(full->ParamInfo(i).name).find("lm_head"), std::string::npos);
  }
  int ready = 0;
  full->AddHook(CAI_HOOK_GRAD_READY, -1, 0, [&](const cai_hook_event&) { ++ready; });
  Batch batch;
  full->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true);
  EXPECT_EQ(ready, 1);  // once, after both uses
  const std::vector<float> both = Floats(full->ParamGrad(0));

  // The head's use alone: back-propagate the last stage only.
  cai_tensor tokens = batch.tokens.desc(), targets = batch.targets.desc();
  Model::StageResult first = staged->StageForward(0, 1, &tokens, nullptr, nullptr);
  cai_tensor hidden = Model::ActivationData(*first.output);
  Model::StageResult last = staged->StageForward(1, 4, nullptr, &targets, &hidden);
  HostTensor<float> grad_hidden({2, 8, 32}, kF32);
  cai_tensor grad_hidden_desc = grad_hidden.desc();
  staged->StageBackward(nullptr, 0, nullptr, &grad_hidden_desc);
  const std::vector<float> head_only = Floats(staged->ParamGrad(0));
  // Token 63 never occurs in the batch: its row is touched only by the output projection.
  EXPECT_NE(head_only[63 * 32], 0.0f);
  EXPECT_EQ(both[63 * 32], head_only[63 * 32]);
  // Token 0 occurs: its row also gets the embedding's gradient.
  EXPECT_NE(both[0], head_only[0]);
  staged->StageBackward(first.output.get(), 0, &grad_hidden_desc, nullptr);
  EXPECT_EQ(Floats(staged->ParamGrad(0)), both);
}

// ---- Storage -------------------------------------------------------------------------------

// The parameters a unit reads: its own, and those of other units it reads (for GPT-2's head
// the tied embedding).
std::vector<uint32_t> ParamsUnitReads(const Model& m, uint32_t unit) {
  cai_unit_info u = m.UnitInfo(unit);
  std::vector<uint32_t> params(u.params, u.params + u.num_params);
  params.insert(params.end(), u.reads, u.reads + u.num_reads);
  return params;
}

// FSDP's pattern: every unit's parameters are released outside its forward and backward and
// gathered (materialised and refilled from a saved copy) in the pre-hooks.
TEST(Storage, ReleaseMaterializeRefillBetweenUses_GradientsEqualUnreleased) {
  auto reference = MakeZooModel(Gpt2Config(), 21), m = MakeZooModel(Gpt2Config(), 21);
  const auto saved = Weights(*m);
  auto used_by = [&](uint32_t unit) { return ParamsUnitReads(*m, unit); };
  auto gather = [&](const cai_hook_event& e) {
    for (uint32_t i : used_by(e.unit)) {
      cai_tensor t = m->MaterializeParamStorage(i);
      std::memcpy(t.data, saved[i].data(), saved[i].size() * sizeof(float));
    }
  };
  auto release = [&](const cai_hook_event& e) {
    for (uint32_t i : used_by(e.unit)) m->ReleaseParamStorage(i);
  };
  m->AddHook(CAI_HOOK_PRE_FORWARD, -1, -1, gather);
  m->AddHook(CAI_HOOK_POST_FORWARD, -1, -1, release);
  m->AddHook(CAI_HOOK_PRE_BACKWARD, -1, -1, gather);
  m->AddHook(CAI_HOOK_POST_BACKWARD, -1, -1, release);
  for (uint32_t i = 0; i < m->NumParams(); ++i) m->ReleaseParamStorage(i);
  EXPECT_TRUE(m->ParamInfo(3).flags & CAI_PARAM_RELEASED);

  Batch batch;
  const double loss = m->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true);
  const double ref_loss =
      reference->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true);
  EXPECT_EQ(loss, ref_loss);
  for (uint32_t i = 0; i < m->NumParams(); ++i) {
    EXPECT_TRUE(m->ParamInfo(i).flags & CAI_PARAM_RELEASED) << i;
    EXPECT_EQ(Floats(m->ParamGrad(i)), Floats(reference->ParamGrad(i))) << m->ParamInfo(i).name;
  }
}

// The same pattern without a copy: each gather lands in a fresh buffer (another address every
// time) that replaces the released storage. Backward reads the parameters through views saved
// in forward (the transposed weights), so this holds only if the released storage is refilled
// in place rather than swapped for a new one.
TEST(Storage, ReplaceReleasedWithFreshBuffers_GradientsEqualUnreleased) {
  auto reference = MakeZooModel(Gpt2Config(), 22), m = MakeZooModel(Gpt2Config(), 22);
  const auto saved = Weights(*m);
  auto used_by = [&](uint32_t unit) { return ParamsUnitReads(*m, unit); };
  std::vector<std::vector<float>> gathered(m->NumParams());
  std::vector<FlatView> views(m->NumParams());
  auto gather = [&](const cai_hook_event& e) {
    for (uint32_t i : used_by(e.unit)) {
      std::vector<float> fresh(saved[i].size() + 16, -1.0f);  // never the previous address
      std::copy(saved[i].begin(), saved[i].end(), fresh.begin() + 16);
      gathered[i].swap(fresh);
      m->ReplaceParamStorage(i, views[i].desc(gathered[i].data() + 16, int64_t(saved[i].size())));
    }
  };
  auto release = [&](const cai_hook_event& e) {
    for (uint32_t i : used_by(e.unit)) {
      m->ReleaseParamStorage(i);
      std::fill(gathered[i].begin(), gathered[i].end(), NAN);  // stale reads would show
    }
  };
  m->AddHook(CAI_HOOK_PRE_FORWARD, -1, -1, gather);
  m->AddHook(CAI_HOOK_POST_FORWARD, -1, -1, release);
  m->AddHook(CAI_HOOK_PRE_BACKWARD, -1, -1, gather);
  m->AddHook(CAI_HOOK_POST_BACKWARD, -1, -1, release);
  for (uint32_t i = 0; i < m->NumParams(); ++i) m->ReleaseParamStorage(i);

  Batch batch;
  const double loss = m->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true);
  EXPECT_EQ(loss, reference->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true));
  for (uint32_t i = 0; i < m->NumParams(); ++i) {
    EXPECT_TRUE(m->ParamInfo(i).flags & CAI_PARAM_RELEASED) << i;
    EXPECT_EQ(Floats(m->ParamGrad(i)), Floats(reference->ParamGrad(i))) << m->ParamInfo(i).name;
  }
}

TEST(Storage, ForwardOnReleasedParameter_FailsNamingIt) {
  auto m = MakeZooModel(Gpt2Config(), 1);
  m->ReleaseParamStorage(4);
  Batch batch;
  try {
    m->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true);
    FAIL() << "ran on released storage";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_FAILED_PRECONDITION);
    EXPECT_NE(std::string(e.what()).find("'blocks.0.attn.qkv.weight' is released"),
              std::string::npos)
        << e.what();
  }
}

TEST(Storage, ParamsAsViewsOfOneFlatBuffer_TrainIdentically) {
  auto reference = MakeZooModel(LlamaConfig(), 31), m = MakeZooModel(LlamaConfig(), 31);
  std::vector<float> flat(TotalNumel(*m));
  std::vector<FlatView> views(m->NumParams());
  int64_t offset = 0;
  for (uint32_t i = 0; i < m->NumParams(); ++i) {
    const std::vector<float> w = Floats(m->ParamData(i));
    std::copy(w.begin(), w.end(), flat.begin() + offset);
    m->ReplaceParamStorage(i, views[i].desc(flat.data() + offset, int64_t(w.size())));
    EXPECT_EQ(m->ParamData(i).data, flat.data() + offset);
    offset += int64_t(w.size());
  }
  Batch batch;
  for (int step = 0; step < 3; ++step) {
    EXPECT_EQ(m->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true),
              reference->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true));
    SgdStep(*m, 0.3f);
    SgdStep(*reference, 0.3f);
  }
  EXPECT_EQ(Weights(*m), Weights(*reference));
  EXPECT_EQ(Floats(m->ParamData(0))[0], flat[0]);  // the updates landed in the flat buffer
}

TEST(Storage, ReplacedGradStorage_ReceivesAndAccumulatesGradients) {
  auto reference = MakeZooModel(Gpt2Config(), 41), m = MakeZooModel(Gpt2Config(), 41);
  std::vector<float> flat(TotalNumel(*m), 0.0f);
  std::vector<FlatView> views(m->NumParams());
  int64_t offset = 0;
  for (uint32_t i = 0; i < m->NumParams(); ++i) {
    const int64_t n = m->ParamInfo(i).numel;
    m->ReplaceGradStorage(i, views[i].desc(flat.data() + offset, n));
    offset += n;
  }
  Batch batch;
  for (int micro = 0; micro < 2; ++micro) {
    m->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true, 1.0, 0.5);
    reference->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true, 1.0, 0.5);
  }
  offset = 0;
  for (uint32_t i = 0; i < m->NumParams(); ++i) {
    EXPECT_EQ(m->ParamGrad(i).data, flat.data() + offset);
    const std::vector<float> ref = Floats(reference->ParamGrad(i));
    EXPECT_TRUE(std::equal(ref.begin(), ref.end(), flat.begin() + offset)) << i;
    offset += int64_t(ref.size());
  }
  m->ZeroGrad(false);
  EXPECT_TRUE(std::all_of(flat.begin(), flat.end(), [](float g) { return g == 0.0f; }));
  m->ReleaseGrad(0);
  EXPECT_THROW(m->ParamGrad(0), Error);
}

// After a strategy is destroyed nothing of the model may point into the memory it handed in:
// parameters it re-homed are released, gradients it re-homed dropped, its hooks gone; the
// parameters it never touched keep their values.
TEST(Storage, DetachStrategy_DropsForeignStorageAndHooks) {
  auto m = MakeZooModel(Gpt2Config(), 43);
  std::vector<float> flat(TotalNumel(*m)), grads(TotalNumel(*m));
  std::vector<FlatView> views(m->NumParams()), grad_views(m->NumParams());
  const std::vector<float> kept = Floats(m->ParamData(1));
  int64_t offset = 0;
  for (uint32_t i = 0; i < m->NumParams(); ++i) {
    const int64_t n = m->ParamInfo(i).numel;
    if (i != 1) {
      const std::vector<float> w = Floats(m->ParamData(i));
      std::copy(w.begin(), w.end(), flat.begin() + offset);
      m->ReplaceParamStorage(i, views[i].desc(flat.data() + offset, n));
    }
    m->ReplaceGradStorage(i, grad_views[i].desc(grads.data() + offset, n));
    offset += n;
  }
  int fired = 0;
  m->AddHook(CAI_HOOK_PRE_FORWARD, -1, -1, [&](const cai_hook_event&) { ++fired; });
  m->DetachStrategy();
  for (uint32_t i = 0; i < m->NumParams(); ++i) {
    EXPECT_EQ(m->ParamInfo(i).flags & CAI_PARAM_RELEASED, i == 1 ? 0u : CAI_PARAM_RELEASED) << i;
    EXPECT_THROW(m->ParamGrad(i), Error) << i;
  }
  EXPECT_EQ(Floats(m->ParamData(1)), kept);
  // Given storage again, the model trains, and the removed hook no longer fires.
  offset = 0;
  for (uint32_t i = 0; i < m->NumParams(); ++i) {
    const int64_t n = m->ParamInfo(i).numel;
    if (i != 1) m->ReplaceParamStorage(i, views[i].desc(flat.data() + offset, n));
    offset += n;
  }
  Batch batch;
  EXPECT_TRUE(std::isfinite(m->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true)));
  EXPECT_EQ(fired, 0);
}

TEST(Storage, LossScaleAndWeight_ScaleGradientsNotLoss) {
  auto plain = MakeZooModel(Gpt2Config(), 51), scaled = MakeZooModel(Gpt2Config(), 51);
  Batch batch;
  const double a = plain->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true);
  const double b =
      scaled->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true, 1024.0, 0.25);
  EXPECT_EQ(a, b);
  const std::vector<float> ga = Floats(plain->ParamGrad(4)), gb = Floats(scaled->ParamGrad(4));
  for (size_t k = 0; k < ga.size(); ++k)
    EXPECT_NEAR(gb[k], 256.0f * ga[k], 1e-3f * std::abs(gb[k]) + 1e-6f);
}

// ---- Lazy initialisation -------------------------------------------------------------------

ModelConfig Lazy(ModelConfig c) {
  c.lazy_init = true;
  return c;
}

std::vector<uint16_t> Halves(const cai_tensor& t) {
  const auto* p =
      reinterpret_cast<const uint16_t*>(static_cast<const char*>(t.data) + t.byte_offset);
  return std::vector<uint16_t>(p, p + t.shape[0] * (t.ndim > 1 ? t.shape[1] : 1));
}

// Nothing is allocated at build (drawing everything afterwards allocates all 4Ψ bytes), a
// parameter is not reported released, and whatever order the parameters are read in, each
// holds the eager model's values bit for bit.
TEST(LazyInit, AllocatesNothingUntilRead_DrawsTheEagerValuesInAnyOrder) {
  for (const ModelConfig& c : {Gpt2Config(), LlamaConfig()}) {
    auto eager = MakeZooModel(c, 99), lazy = MakeZooModel(Lazy(c), 99);
    for (uint32_t i = 0; i < lazy->NumParams(); ++i) {
      EXPECT_FALSE(lazy->ParamInfo(i).flags & CAI_PARAM_RELEASED) << i;
    }
    const auto expected = Weights(*eager);
    for (uint32_t i = lazy->NumParams(); i-- > 0;) {
      EXPECT_EQ(Floats(lazy->ParamData(i)), expected[i]) << lazy->ParamInfo(i).name;
    }
    auto untouched = MakeZooModel(Lazy(c), 99);
    EXPECT_EQ(untouched->InitPendingParams(), static_cast<uint64_t>(4 * TotalNumel(*untouched)));
    EXPECT_EQ(untouched->InitPendingParams(), 0u);
    EXPECT_EQ(Weights(*untouched), expected);
  }
}

// A forward draws what it reads; gradients equal the eager model's.
TEST(LazyInit, ForwardDrawsWhatItReads_GradientsEqualEager) {
  auto eager = MakeZooModel(Gpt2Config(), 5), lazy = MakeZooModel(Lazy(Gpt2Config()), 5);
  Batch batch;
  EXPECT_EQ(lazy->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true),
            eager->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true));
  EXPECT_EQ(Grads(*lazy), Grads(*eager));
}

// A parameter released before any read is dropped undrawn (reported released, param_data
// refuses it, and nothing draws it later); set_compute_dtype before the first read gives the
// eager model's converted values; materialize_param_storage draws too.
TEST(LazyInit, ReleaseDropsUndrawn_ComputeDtypeAndMaterializeDrawEagerValues) {
  auto eager = MakeZooModel(Gpt2Config(), 3), lazy = MakeZooModel(Lazy(Gpt2Config()), 3);
  lazy->ReleaseParamStorage(4);
  EXPECT_TRUE(lazy->ParamInfo(4).flags & CAI_PARAM_RELEASED);
  EXPECT_THROW(lazy->ParamData(4), Error);
  const int64_t dropped = lazy->ParamInfo(4).numel;
  EXPECT_EQ(lazy->InitPendingParams(), static_cast<uint64_t>(4 * (TotalNumel(*lazy) - dropped)));
  EXPECT_TRUE(lazy->ParamInfo(4).flags & CAI_PARAM_RELEASED);

  const cai_dtype bf16{CAI_DTYPE_BFLOAT, 16, 1};
  auto lazy16 = MakeZooModel(Lazy(Gpt2Config()), 3);
  lazy16->SetComputeDtype(bf16);
  eager->SetComputeDtype(bf16);
  for (uint32_t i = 0; i < eager->NumParams(); ++i) {
    EXPECT_EQ(Halves(lazy16->ParamData(i)), Halves(eager->ParamData(i))) << i;
  }
  auto materialized = MakeZooModel(Lazy(Gpt2Config()), 3);
  auto fp32 = MakeZooModel(Gpt2Config(), 3);
  EXPECT_EQ(Floats(materialized->MaterializeParamStorage(2)), Floats(fp32->ParamData(2)));
}

// ---- Hooks ---------------------------------------------------------------------------------

std::string Name(const cai_hook_event& e) {
  switch (e.kind) {
    case CAI_HOOK_PRE_STEP_FORWARD:
      return "step";
    case CAI_HOOK_PRE_FORWARD:
      return std::string(e.recompute ? "re" : "") + "pre_fwd" + std::to_string(e.unit);
    case CAI_HOOK_POST_FORWARD:
      return std::string(e.recompute ? "re" : "") + "post_fwd" + std::to_string(e.unit);
    case CAI_HOOK_PRE_BACKWARD:
      return "pre_bwd" + std::to_string(e.unit);
    case CAI_HOOK_POST_BACKWARD:
      return "post_bwd" + std::to_string(e.unit);
    case CAI_HOOK_GRAD_READY:
      return "ready" + std::to_string(e.param);
  }
  return "?";
}

// Records every hook kind; runs of GRAD_READY are sorted, their order within a unit being
// unspecified.
std::vector<std::string> RecordOneStep(Model& m) {
  std::vector<std::string> events;
  std::vector<uint64_t> ids;
  for (cai_hook_kind k : {CAI_HOOK_PRE_STEP_FORWARD, CAI_HOOK_PRE_FORWARD, CAI_HOOK_POST_FORWARD,
                          CAI_HOOK_PRE_BACKWARD, CAI_HOOK_POST_BACKWARD, CAI_HOOK_GRAD_READY}) {
    ids.push_back(
        m.AddHook(k, -1, -1, [&](const cai_hook_event& e) { events.push_back(Name(e)); }));
  }
  Batch batch;
  m.ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true);
  for (uint64_t id : ids) m.RemoveHook(id);
  for (auto it = events.begin(); it != events.end();) {
    auto end = std::find_if(it, events.end(),
                            [](const std::string& s) { return s.rfind("ready", 0) != 0; });
    std::sort(it, end, [](const std::string& a, const std::string& b) {
      return std::stoi(a.substr(5)) < std::stoi(b.substr(5));
    });
    it = end == events.end() ? end : end + 1;
  }
  return events;
}

std::vector<std::string> ExpectedOrder(bool checkpointing) {
  // Parameters: wte 0, wpe 1, block 0: 2..13, block 1: 14..25, ln_f 26, 27.
  auto ready = [](int first, int last) {
    std::vector<std::string> r;
    for (int i = first; i <= last; ++i) r.push_back("ready" + std::to_string(i));
    return r;
  };
  std::vector<std::string> e = {"step",     "pre_fwd0",  "post_fwd0", "pre_fwd1",  "post_fwd1",
                                "pre_fwd2", "post_fwd2", "pre_fwd3",  "post_fwd3", "pre_bwd3"};
  for (auto& s : ready(26, 27)) e.push_back(s);
  e.push_back("post_bwd3");
  for (int unit : {2, 1}) {
    e.push_back("pre_bwd" + std::to_string(unit));
    if (checkpointing) {
      e.push_back("repre_fwd" + std::to_string(unit));
      e.push_back("repost_fwd" + std::to_string(unit));
    }
    for (auto& s : ready(2 + 12 * (unit - 1), 13 + 12 * (unit - 1))) e.push_back(s);
    e.push_back("post_bwd" + std::to_string(unit));
  }
  e.push_back("pre_bwd0");
  for (auto& s : ready(0, 1)) e.push_back(s);
  e.push_back("post_bwd0");
  return e;
}

TEST(Hooks, TwoBlockGpt2_FireInDocumentedOrder) {
  auto m = MakeZooModel(Gpt2Config(), 61);
  EXPECT_EQ(RecordOneStep(*m), ExpectedOrder(false));
}

TEST(Hooks, WithCheckpointing_RecomputeFiresForwardHooksInBackward) {
  auto m = MakeZooModel(Gpt2Config(), 61);
  m->SetActivationCheckpointing(true);
  EXPECT_EQ(RecordOneStep(*m), ExpectedOrder(true));
}

TEST(Hooks, ThrowingHook_AbortsWithItsError) {
  auto m = MakeZooModel(Gpt2Config(), 71);
  Batch batch;
  for (cai_hook_kind kind :
       {CAI_HOOK_PRE_FORWARD, CAI_HOOK_PRE_BACKWARD, CAI_HOOK_GRAD_READY, CAI_HOOK_POST_BACKWARD}) {
    const uint64_t id = m->AddHook(
        kind, kind == CAI_HOOK_GRAD_READY ? -1 : 2, -1,
        [](const cai_hook_event&) { throw Error(CAI_ABORTED, "gather failed on rank 3"); });
    try {
      m->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true);
      FAIL() << "hook kind " << kind << " did not abort";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), CAI_ABORTED) << kind;
      EXPECT_STREQ(e.what(), "gather failed on rank 3");
    }
    m->RemoveHook(id);
  }
  // The model still works afterwards.
  EXPECT_NEAR(m->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true), std::log(64.0),
              0.1);
}

// ---- Checkpointing and stages ----------------------------------------------------------------

TEST(Checkpointing, GradientsEqualWithoutCheckpointing) {
  for (ModelConfig c : {Gpt2Config(), LlamaConfig()}) {
    auto plain = MakeZooModel(c, 81), ckpt = MakeZooModel(c, 81);
    ckpt->SetActivationCheckpointing(true);
    Batch batch;
    EXPECT_EQ(plain->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true),
              ckpt->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true));
    EXPECT_EQ(Grads(*plain), Grads(*ckpt)) << plain->Describe();
  }
}

TEST(Stages, TwoStagesForwardBackward_EqualWholeModelGradients) {
  for (ModelConfig c : {Gpt2Config(), LlamaConfig()}) {
    auto whole = MakeZooModel(c, 91), staged = MakeZooModel(c, 91);
    Batch batch;
    const double loss = whole->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true);
    cai_tensor tokens = batch.tokens.desc(), targets = batch.targets.desc();
    const int32_t k = 2, n = int32_t(staged->NumUnits());
    Model::StageResult first = staged->StageForward(0, k, &tokens, nullptr, nullptr);
    HostTensor<float> sent({2, 8, 32}, kF32);  // as if sent over the wire
    std::vector<float> h = Floats(Model::ActivationData(*first.output));
    std::copy(h.begin(), h.end(), sent.data.begin());
    cai_tensor sent_desc = sent.desc();
    Model::StageResult last = staged->StageForward(k, n, nullptr, &targets, &sent_desc);
    EXPECT_EQ(last.output, nullptr);
    EXPECT_EQ(last.loss, loss);
    HostTensor<float> grad({2, 8, 32}, kF32);
    cai_tensor grad_desc = grad.desc();
    staged->StageBackward(nullptr, 0, nullptr, &grad_desc);
    staged->StageBackward(first.output.get(), 0, &grad_desc, nullptr);
    EXPECT_LT(MaxAbsDiff(Grads(*staged), Grads(*whole)), 1e-6) << staged->Describe();
  }
}

// Evaluation through a pipeline: forward-only stages build no graph, so the last stage can run
// again at once (nothing awaits a stage_backward), no gradient appears, and the losses are
// those of a training forward.
TEST(Stages, NoGradStageForward_KeepsNoGraphAndLeavesGradientsAlone) {
  for (ModelConfig c : {Gpt2Config(), LlamaConfig()}) {
    auto m = MakeZooModel(c, 91), whole = MakeZooModel(c, 91);
    Batch batch;
    const double expected = whole->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true);
    cai_tensor tokens = batch.tokens.desc(), targets = batch.targets.desc();
    const int32_t k = 2, n = int32_t(m->NumUnits());
    int forwards = 0, backwards = 0;
    m->AddHook(CAI_HOOK_PRE_FORWARD, -1, -1, [&](const cai_hook_event&) { ++forwards; });
    m->AddHook(CAI_HOOK_GRAD_READY, -1, -1, [&](const cai_hook_event&) { ++backwards; });
    Model::StageResult first = m->StageForward(0, k, &tokens, nullptr, nullptr, /*no_grad=*/true);
    ASSERT_NE(first.output, nullptr);
    cai_tensor hidden = Model::ActivationData(*first.output);
    for (int i = 0; i < 2; ++i) {
      Model::StageResult last = m->StageForward(k, n, nullptr, &targets, &hidden, true);
      EXPECT_EQ(last.output, nullptr);
      EXPECT_EQ(last.loss, expected) << m->Describe();
    }
    EXPECT_EQ(forwards, k + 2 * (n - k));  // hooks fire as in any forward
    EXPECT_EQ(backwards, 0);
    for (uint32_t i = 0; i < m->NumParams(); ++i) {
      EXPECT_THROW(m->ParamGrad(i), Error) << m->ParamInfo(i).name;  // no gradient appeared
    }
    HostTensor<float> grad({2, 8, 32}, kF32);
    cai_tensor grad_desc = grad.desc();
    try {
      m->StageBackward(first.output.get(), 0, &grad_desc, nullptr);
      FAIL() << "a no_grad activation was back-propagated";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), CAI_FAILED_PRECONDITION);
      EXPECT_NE(std::string(e.what()).find("no_grad stage_forward"), std::string::npos);
    }
    EXPECT_THROW(m->StageBackward(nullptr, 0, nullptr, nullptr), Error);  // none waits
    // A training forward afterwards is micro-batch 0 and back-propagates as usual.
    Model::StageResult trained = m->StageForward(k, n, nullptr, &targets, &hidden);
    EXPECT_EQ(trained.loss, expected);
    m->StageBackward(nullptr, 0, nullptr, &grad_desc);
    EXPECT_GT(backwards, 0);
  }
}

TEST(Stages, UnknownLastStageMicroBatch_IsNotFound) {
  auto m = MakeZooModel(Gpt2Config(), 1);
  try {
    m->StageBackward(nullptr, 5, nullptr, nullptr);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), CAI_NOT_FOUND);
  }
}

// ---- Split backward ----------------------------------------------------------------------

// The projections of the transformer blocks: what a split backward defers.
bool Deferred(Model& m, uint32_t i) {
  const cai_param_info info = m.ParamInfo(i);
  return info.unit >= 1 && info.unit <= 2 && info.role != CAI_ROLE_NORM;
}

// Two stages of a two-block model, both split: after their stage_backward every gradient but
// the blocks' projections' is there, the projections' (weights and biases) have none, and the
// weight passes complete them to the whole model's. GRAD_READY fires once per parameter, and a
// block's POST_BACKWARD only in its weight pass. With and without activation checkpointing
// (whose recomputation in backward defers as the forward would have).
TEST(SplitBackward, WeightPassesCompleteTheGradients_EqualUnsplit) {
  for (ModelConfig c : {Gpt2Config(), LlamaConfig()}) {
    for (bool checkpointing : {false, true}) {
      auto whole = MakeZooModel(c, 93), m = MakeZooModel(c, 93);
      m->SetActivationCheckpointing(checkpointing);
      const std::string what = std::string(m->Describe()) + (checkpointing ? " checkpointing" : "");
      Batch batch;
      const double loss = whole->ForwardBackward(batch.tokens.desc(), batch.targets.desc(), true);
      // GRAD_READY fires once per stage_backward that reaches a parameter: twice for GPT-2's
      // tied embedding, read by both stages.
      std::vector<int> expected_ready(m->NumParams(), 1);
      if (c.arch == ModelConfig::Arch::kGpt2) expected_ready[0] = 2;
      std::vector<int> ready(m->NumParams(), 0);
      std::vector<std::string> post;
      m->AddHook(CAI_HOOK_GRAD_READY, -1, -1, [&](const cai_hook_event& e) { ++ready[e.param]; });
      m->AddHook(CAI_HOOK_POST_BACKWARD, -1, -1, [&](const cai_hook_event& e) {
        post.push_back("post_bwd" + std::to_string(e.unit));
      });
      cai_tensor tokens = batch.tokens.desc(), targets = batch.targets.desc();
      const int32_t n = int32_t(m->NumUnits());
      // Stage 0: the embedding and block 1; stage 1: block 2 and the head.
      Model::StageResult first =
          m->StageForward(0, 2, &tokens, nullptr, nullptr, false, /*split_backward=*/true);
      cai_tensor hidden = Model::ActivationData(*first.output);
      Model::StageResult last = m->StageForward(2, n, nullptr, &targets, &hidden, false, true);
      EXPECT_EQ(last.loss, loss) << what;
      HostTensor<float> grad({2, 8, 32}, kF32);
      cai_tensor grad_desc = grad.desc();
      m->StageBackward(nullptr, 0, nullptr, &grad_desc);
      m->StageBackward(first.output.get(), 0, &grad_desc, nullptr);
      // The caller's gradient buffer is borrowed for the call only: the weight pass must not
      // read it.
      std::fill(grad.data.begin(), grad.data.end(), 1e3f);
      EXPECT_EQ(post, (std::vector<std::string>{"post_bwd3", "post_bwd0"})) << what;
      for (uint32_t i = 0; i < m->NumParams(); ++i) {
        if (Deferred(*m, i)) {
          EXPECT_THROW(m->ParamGrad(i), Error) << what << " " << m->ParamInfo(i).name;
          EXPECT_EQ(ready[i], 0) << what << " " << m->ParamInfo(i).name;
        } else {
          EXPECT_EQ(ready[i], expected_ready[i]) << what << " " << m->ParamInfo(i).name;
        }
      }
      // The weight passes in either order: the last stage's first here.
      m->StageBackwardWeights(nullptr, 0);
      m->StageBackwardWeights(first.output.get(), 0);
      EXPECT_EQ(post,
                (std::vector<std::string>{"post_bwd3", "post_bwd0", "post_bwd2", "post_bwd1"}))
          << what;
      EXPECT_EQ(ready, expected_ready) << what;
      EXPECT_LT(MaxAbsDiff(Grads(*m), Grads(*whole)), 1e-6) << what;
    }
  }
}

// Gradients accumulate over micro-batches across the passes as they do unsplit: a second
// micro-batch's weight pass adds to the first's.
TEST(SplitBackward, TwoMicroBatches_AccumulateAsUnsplit) {
  auto whole = MakeZooModel(LlamaConfig(), 95), m = MakeZooModel(LlamaConfig(), 95);
  Batch batch;
  cai_tensor tokens = batch.tokens.desc(), targets = batch.targets.desc();
  const int32_t n = int32_t(m->NumUnits());
  for (int mb = 0; mb < 2; ++mb) {
    whole->ForwardBackward(tokens, targets, true, 1.0, 0.5);
    m->StageForward(0, n, &tokens, &targets, nullptr, false, true);
  }
  m->StageBackward(nullptr, 0, nullptr, nullptr, 0.5);
  m->StageBackward(nullptr, 1, nullptr, nullptr, 0.5);
  m->StageBackwardWeights(nullptr, 1);
  m->StageBackwardWeights(nullptr, 0);
  EXPECT_LT(MaxAbsDiff(Grads(*m), Grads(*whole)), 1e-6);
}

TEST(SplitBackward, MisuseFailsNamingWhatToDo) {
  auto m = MakeZooModel(Gpt2Config(), 97);
  Batch batch;
  cai_tensor tokens = batch.tokens.desc(), targets = batch.targets.desc();
  const int32_t n = int32_t(m->NumUnits());
  HostTensor<float> grad({2, 8, 32}, kF32);
  cai_tensor grad_desc = grad.desc();
  auto expect = [](cai_status_code code, const std::string& text, auto&& call) {
    try {
      call();
      ADD_FAILURE() << "no error; expected one saying " << text;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), code) << e.what();
      EXPECT_NE(std::string(e.what()).find(text), std::string::npos) << e.what();
    }
  };
  expect(CAI_INVALID_ARGUMENT, "split_backward with no_grad",
         [&] { m->StageForward(0, 2, &tokens, nullptr, nullptr, true, true); });
  // Not split: stage_backward computed everything.
  Model::StageResult plain = m->StageForward(0, 2, &tokens, nullptr, nullptr);
  m->StageBackward(plain.output.get(), 0, &grad_desc, nullptr);
  expect(CAI_FAILED_PRECONDITION, "was not split",
         [&] { m->StageBackwardWeights(plain.output.get(), 0); });
  // Before its stage_backward, and twice.
  Model::StageResult split = m->StageForward(0, 2, &tokens, nullptr, nullptr, false, true);
  expect(CAI_FAILED_PRECONDITION, "stage_backward first",
         [&] { m->StageBackwardWeights(split.output.get(), 0); });
  m->StageBackward(split.output.get(), 0, &grad_desc, nullptr);
  m->StageBackwardWeights(split.output.get(), 0);
  expect(CAI_FAILED_PRECONDITION, "already computed",
         [&] { m->StageBackwardWeights(split.output.get(), 0); });
  // The last stage: unknown, and not yet back-propagated.
  expect(CAI_NOT_FOUND, "no last-stage micro_batch 4",
         [&] { m->StageBackwardWeights(nullptr, 4); });
  m->StageForward(2, n, nullptr, &targets, &grad_desc, false, true);
  expect(CAI_FAILED_PRECONDITION, "run its stage_backward first",
         [&] { m->StageBackwardWeights(nullptr, 0); });
  m->StageBackward(nullptr, 0, nullptr, nullptr);
  m->StageBackwardWeights(nullptr, 0);
  // A split last stage holding no block defers nothing and still takes its (empty) weight pass.
  m->StageForward(n - 1, n, nullptr, &targets, &grad_desc, false, true);
  m->StageBackward(nullptr, 1, nullptr, nullptr);
  m->StageBackwardWeights(nullptr, 1);
  // An activation released before its weight pass loses gradients: every call fails until
  // zero_grad starts the step again.
  Model::StageResult lost = m->StageForward(0, 2, &tokens, nullptr, nullptr, false, true);
  m->StageBackward(lost.output.get(), 0, &grad_desc, nullptr);
  lost.output.reset();
  expect(CAI_FAILED_PRECONDITION, "call zero_grad",
         [&] { m->StageForward(0, 2, &tokens, nullptr, nullptr); });
  expect(CAI_FAILED_PRECONDITION, "released before stage_backward_weights",
         [&] { m->ForwardBackward(tokens, targets, true); });
  m->ZeroGrad(true);
  EXPECT_NEAR(m->ForwardBackward(tokens, targets, true), std::log(64.0), 0.1);
}

// ---- The ABI table -------------------------------------------------------------------------

TEST(ModelApi, Table_IsFullyFilled) {
  const cai_model_api* api = ModelApi();
  ASSERT_EQ(api->struct_size, CAI_MODEL_API_STRUCT_SIZE);
  const size_t first = offsetof(cai_model_api, num_params);
  const size_t count = (CAI_MODEL_API_STRUCT_SIZE - first) / sizeof(void (*)());
  for (size_t i = 0; i < count; ++i) {
    void (*fn)();
    std::memcpy(&fn, reinterpret_cast<const char*>(api) + first + i * sizeof(fn), sizeof(fn));
    EXPECT_NE(fn, nullptr) << "entry " << i;
  }
}

struct StatusText {
  cai_status_code code;
  std::string message;
};
StatusText Take(cai_status* s) {
  StatusText t{StatusCode(s), StatusMessage(s)};
  DestroyStatus(s);
  return t;
}

TEST(ModelApi, BadArguments_ReturnStatusesNamingThem) {
  auto m = MakeZooModel(Gpt2Config(), 1);
  const cai_model_api* api = ModelApi();
  cai_model* h = AsHandle(m.get());
  EXPECT_EQ(api->num_params(h), 28u);
  cai_param_info info{};
  info.struct_size = CAI_PARAM_INFO_STRUCT_SIZE;
  StatusText s = Take(api->param_info(h, 28, &info));
  EXPECT_EQ(s.code, CAI_INVALID_ARGUMENT);
  EXPECT_EQ(s.message, "param_info: parameter index 28 out of range (the model has 28 parameters)");
  s = Take(api->param_info(h, 0, nullptr));
  EXPECT_EQ(s.message, "param_info: out is NULL");
  info.struct_size = 8;
  s = Take(api->param_info(h, 0, &info));
  EXPECT_EQ(s.code, CAI_INVALID_ARGUMENT);
  EXPECT_EQ(s.message, "param_info: out.struct_size is 8, smaller than the " +
                           std::to_string(CAI_STRUCT_SIZE(cai_param_info, parallel_dim)) +
                           " bytes of ABI v1.0: set it to the struct's CAI_*_STRUCT_SIZE macro");
  info.struct_size = CAI_PARAM_INFO_STRUCT_SIZE;
  ASSERT_EQ(api->param_info(h, 0, &info), nullptr);
  EXPECT_STREQ(info.name, "wte.weight");
  s = Take(api->forward_backward(h, nullptr));
  EXPECT_EQ(s.message, "forward_backward: args is NULL");
  s = Take(api->zero_grad(nullptr, true));
  EXPECT_EQ(s.message, "zero_grad: model is NULL");
  cai_tensor_parallel_args tp{
      CAI_TENSOR_PARALLEL_ARGS_STRUCT_SIZE, nullptr, nullptr, false, -1, false, false};
  s = Take(api->apply_tensor_parallel(h, &tp));
  EXPECT_EQ(s.message, "apply_tensor_parallel: vocab_divisible_by must be >= 0, got -1");
  tp.vocab_divisible_by = 1;
  tp.sequence_parallel_ring = true;
  s = Take(api->apply_tensor_parallel(h, &tp));
  EXPECT_EQ(s.message,
            "apply_tensor_parallel: sequence_parallel_ring overlaps sequence parallelism's "
            "gathers and reduce-scatters; set sequence_parallel too");
  tp.sequence_parallel_ring = false;
  s = Take(api->apply_tensor_parallel(h, &tp));  // no communicator in this process
  EXPECT_EQ(s.code, CAI_FAILED_PRECONDITION);
  EXPECT_NE(s.message.find("communicator is not initialised"), std::string::npos) << s.message;
  s = Take(api->set_buffer_dtype(h, cai_dtype{CAI_DTYPE_INT, 64, 1}));
  EXPECT_EQ(s.code, CAI_INVALID_ARGUMENT);
  EXPECT_EQ(s.message, "set_buffer_dtype: only fp32, bf16 and fp16 are supported");
  EXPECT_EQ(api->set_buffer_dtype(h, cai_dtype{CAI_DTYPE_BFLOAT, 16, 1}), nullptr);  // none
  EXPECT_NE(std::string(api->describe(h)).find("gpt2 vocab_size=64"), std::string::npos);
}

cai_status* RefuseBackward(void* user_data, const cai_hook_event* event) {
  ++*static_cast<int*>(user_data);
  return event->unit == 1 ? MakeStatus(CAI_DATA_LOSS, "shard checksum mismatch") : nullptr;
}

TEST(ModelApi, HookReturningError_AbortsForwardBackwardWithThatStatus) {
  auto m = MakeZooModel(Gpt2Config(), 1);
  const cai_model_api* api = ModelApi();
  cai_model* h = AsHandle(m.get());
  int calls = 0;
  cai_hook_args hook{
      CAI_HOOK_ARGS_STRUCT_SIZE, nullptr, CAI_HOOK_PRE_BACKWARD, -1, -1, RefuseBackward, &calls};
  uint64_t id = 0;
  ASSERT_EQ(api->register_hook(h, &hook, &id), nullptr);
  Batch batch;
  cai_tensor tokens = batch.tokens.desc(), targets = batch.targets.desc();
  double loss = -1;
  cai_forward_backward_args args{
      CAI_FORWARD_BACKWARD_ARGS_STRUCT_SIZE, nullptr, &tokens, &targets, true, 0.0, 0.0, &loss};
  StatusText s = Take(api->forward_backward(h, &args));
  EXPECT_EQ(s.code, CAI_DATA_LOSS);
  EXPECT_EQ(s.message, "shard checksum mismatch");
  EXPECT_EQ(calls, 3);  // head, block 1, then block 0 refuses
  EXPECT_EQ(loss, -1);  // out-parameters untouched on error
  ASSERT_EQ(api->remove_hook(h, id), nullptr);
  ASSERT_EQ(api->forward_backward(h, &args), nullptr);
  EXPECT_NEAR(loss, std::log(64.0), 0.05);
}

// A plugin built from the 1.0 headers passes cai_unit_info and cai_stage_forward_args at
// their 1.0 sizes: the host serves it within them and reads nothing newer.
TEST(ModelApi, CallerWithAbi10StructSizes_IsServedWithinThem) {
  auto m = MakeZooModel(Gpt2Config(), 2);
  const cai_model_api* api = ModelApi();
  cai_model* h = AsHandle(m.get());
  constexpr size_t kUnitInfo10 = CAI_STRUCT_SIZE(cai_unit_info, numel);
  cai_unit_info info;
  std::memset(&info, 0xAB, sizeof info);  // the bytes past a 1.0 struct are not the host's
  info.struct_size = kUnitInfo10;
  info.extension_start = nullptr;
  ASSERT_EQ(api->unit_info(h, 3, &info), nullptr);
  EXPECT_EQ(info.struct_size, kUnitInfo10);
  EXPECT_STREQ(info.name, "head");
  EXPECT_EQ(info.num_params, 2u);
  const auto* tail = reinterpret_cast<const unsigned char*>(&info) + kUnitInfo10;
  EXPECT_TRUE(std::all_of(tail, tail + (sizeof info - kUnitInfo10),
                          [](unsigned char b) { return b == 0xAB; }));
  EXPECT_FALSE(CAI_HAS_FIELD(&info, cai_unit_info, reads));
  cai_unit_info full{};
  full.struct_size = CAI_UNIT_INFO_STRUCT_SIZE;
  ASSERT_EQ(api->unit_info(h, 3, &full), nullptr);
  ASSERT_TRUE(CAI_HAS_FIELD(&full, cai_unit_info, reads));
  ASSERT_EQ(full.num_reads, 1u);
  EXPECT_EQ(full.reads[0], 0u);

  // A 1.0 stage_forward_args ends at `loss`: the byte where no_grad would be is not read, so
  // the forward keeps its graph for the stage_backward that follows.
  Batch batch;
  cai_tensor tokens = batch.tokens.desc(), targets = batch.targets.desc();
  double loss = 0;
  cai_stage_forward_args args;
  std::memset(&args, 1, sizeof args);
  args.struct_size = CAI_STRUCT_SIZE(cai_stage_forward_args, loss);
  args.extension_start = nullptr;
  args.first_unit = 0;
  args.last_unit = 4;
  args.tokens = &tokens;
  args.targets = &targets;
  args.input = nullptr;
  args.output = nullptr;
  args.loss = &loss;
  ASSERT_EQ(api->stage_forward(h, &args), nullptr);
  EXPECT_NEAR(loss, std::log(64.0), 0.05);
  cai_stage_backward_args b{
      CAI_STAGE_BACKWARD_ARGS_STRUCT_SIZE, nullptr, nullptr, nullptr, nullptr, 0, 0.0};
  ASSERT_EQ(api->stage_backward(h, &b), nullptr);
  cai_tensor g{};
  EXPECT_EQ(api->param_grad(h, 0, &g), nullptr);
  // A 1.3 caller asking for no_grad gets a loss and no graph: nothing awaits a backward. One
  // built before split_backward was appended passes a struct ending at no_grad, and the byte
  // after it (still 1 here) is not read.
  const double trained = loss;
  args.struct_size = CAI_STRUCT_SIZE(cai_stage_forward_args, no_grad);
  args.no_grad = true;
  ASSERT_EQ(api->stage_forward(h, &args), nullptr);
  EXPECT_EQ(loss, trained);
  b.micro_batch = 1;
  StatusText s = Take(api->stage_backward(h, &b));
  EXPECT_EQ(s.code, CAI_NOT_FOUND);
}

TEST(ModelApi, StageHandles_RoundTripThroughTheTable) {
  auto m = MakeZooModel(LlamaConfig(), 2);
  const cai_model_api* api = ModelApi();
  cai_model* h = AsHandle(m.get());
  Batch batch;
  cai_tensor tokens = batch.tokens.desc(), targets = batch.targets.desc();
  cai_activation* act = nullptr;
  cai_stage_forward_args f{CAI_STAGE_FORWARD_ARGS_STRUCT_SIZE,
                           nullptr,
                           0,
                           3,
                           &tokens,
                           nullptr,
                           nullptr,
                           &act,
                           nullptr,
                           false,
                           /*split_backward=*/true};
  ASSERT_EQ(api->stage_forward(h, &f), nullptr);
  cai_tensor data{};
  ASSERT_EQ(api->activation_data(act, &data), nullptr);
  double loss = 0;
  cai_stage_forward_args l{CAI_STAGE_FORWARD_ARGS_STRUCT_SIZE,
                           nullptr,
                           3,
                           4,
                           nullptr,
                           &targets,
                           &data,
                           nullptr,
                           &loss,
                           false,
                           false};
  ASSERT_EQ(api->stage_forward(h, &l), nullptr);
  EXPECT_NEAR(loss, std::log(64.0), 0.05);
  HostTensor<float> grad({2, 8, 32}, kF32);
  cai_tensor grad_desc = grad.desc();
  cai_stage_backward_args b{
      CAI_STAGE_BACKWARD_ARGS_STRUCT_SIZE, nullptr, nullptr, nullptr, &grad_desc, 0, 0.0};
  ASSERT_EQ(api->stage_backward(h, &b), nullptr);
  cai_stage_backward_args b0{
      CAI_STAGE_BACKWARD_ARGS_STRUCT_SIZE, nullptr, act, &grad_desc, nullptr, 0, 0.0};
  ASSERT_EQ(api->stage_backward(h, &b0), nullptr);
  cai_tensor g{};
  EXPECT_EQ(api->param_grad(h, 0, &g), nullptr);
  // The first stage's projections (parameter 2 is block 0's attention query) have their
  // gradients after the weight pass.
  EXPECT_EQ(Take(api->param_grad(h, 2, &g)).code, CAI_FAILED_PRECONDITION);
  cai_stage_backward_weights_args w{CAI_STAGE_BACKWARD_WEIGHTS_ARGS_STRUCT_SIZE, nullptr, act, 0};
  ASSERT_EQ(api->stage_backward_weights(h, &w), nullptr);
  EXPECT_EQ(api->param_grad(h, 2, &g), nullptr);
  api->activation_release(act);
  api->activation_release(nullptr);
}

}  // namespace
}  // namespace cai
