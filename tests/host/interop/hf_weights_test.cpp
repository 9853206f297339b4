// Hugging Face interop: the name map covers the zoo's models exactly, export then init_from is
// bit-exact (also through fsdp's sharded layout and several files), a config that describes
// another model is refused, and PyTorch computes cai's loss and gradients from the exported
// weights (torch_reference.py, GPT-2 and Llama written as transformers writes them).
#include "interop/hf_weights.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <set>

#include "checkpoint/checkpoint.h"
#include "checkpoint/safetensors.h"
#include "core/status.h"
#include "interop/hf_layout.h"
#include "model/model.h"
#include "util/subprocess.h"
#include "util/temp_dir.h"

namespace cai::interop {
namespace {

namespace fs = std::filesystem;

constexpr cai_dtype kF32{CAI_DTYPE_FLOAT, 32, 1};
constexpr cai_dtype kF64{CAI_DTYPE_FLOAT, 64, 1};
constexpr cai_dtype kI64{CAI_DTYPE_INT, 64, 1};

// Every TempDir of this file under /tmp/cai-interop-XXXXXX.
class TempDir : public cai::testing::TempDir {
 public:
  TempDir() : cai::testing::TempDir("cai-interop") {}
};

ModelConfig Gpt2(bool bias = true) {
  ModelConfig c;
  c.arch = ModelConfig::Arch::kGpt2;
  c.vocab_size = 64;
  c.n_ctx = 16;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_embd = 32;
  c.bias = bias;
  return c;
}

ModelConfig Llama(bool bias = false) {
  ModelConfig c;
  c.arch = ModelConfig::Arch::kLlama;
  c.vocab_size = 64;
  c.n_ctx = 16;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.n_embd = 32;
  c.bias = bias;
  c.norm_eps = 1e-6;
  c.rope_theta = 500000.0;
  return c;
}

std::vector<float> Floats(const cai_tensor& t) {
  int64_t n = 1;
  for (int d = 0; d < t.ndim; ++d) n *= t.shape[d];
  const auto* p = reinterpret_cast<const float*>(static_cast<const char*>(t.data) + t.byte_offset);
  return std::vector<float>(p, p + n);
}

std::map<std::string, std::vector<float>> Weights(Model& m) {
  std::map<std::string, std::vector<float>> out;
  for (uint32_t i = 0; i < m.NumParams(); ++i) out[m.ParamInfo(i).name] = Floats(m.ParamData(i));
  return out;
}

// The canonical layout a full save of every strategy writes: "model/<name>", fp32.
fs::path SaveCanonical(Model& m, const fs::path& run_dir, int64_t step) {
  ckpt::CheckpointWriter writer(run_dir, step, 0, 1, "test");
  for (uint32_t i = 0; i < m.NumParams(); ++i) {
    const cai_tensor t = m.ParamData(i);
    ThrowIfError(CheckpointApi()->write_tensor(
        writer.handle(), ("model/" + std::string(m.ParamInfo(i).name)).c_str(), &t));
  }
  return writer.Commit([] {});
}

TEST(HfLayout, CoversEveryZooParameterOnceWithItsSize) {
  for (const ModelConfig& c : {Gpt2(true), Gpt2(false), Llama(false), Llama(true)}) {
    auto m = MakeZooModel(c, 1);
    std::map<std::string, int64_t> numel;
    for (uint32_t i = 0; i < m->NumParams(); ++i)
      numel[m->ParamInfo(i).name] = m->ParamInfo(i).numel;
    std::set<std::string> seen;
    for (const HfTensor& t : HfLayout(c)) {
      if (t.cai_name.empty()) continue;
      ASSERT_TRUE(numel.count(t.cai_name)) << t.hf_name << " -> " << t.cai_name;
      EXPECT_TRUE(seen.insert(t.cai_name).second) << t.cai_name;
      int64_t n = 1;
      for (int64_t d : t.shape) n *= d;
      EXPECT_EQ(n, numel[t.cai_name]) << t.hf_name;
    }
    EXPECT_EQ(seen.size(), numel.size()) << m->Describe();
  }
}

TEST(HfWeights, ExportThenInitFrom_BitExactForGpt2AndLlama) {
  for (const ModelConfig& c : {Gpt2(true), Gpt2(false), Llama(false), Llama(true)}) {
    TempDir dir;
    auto saved = MakeZooModel(c, 7);
    const fs::path ckpt = SaveCanonical(*saved, dir / "run", 3);
    // Small files: the index must send each tensor to the right one.
    ExportOptions options;
    options.max_shard_bytes = 20000;
    const ExportResult r = ExportSafetensors(ckpt, c, dir / "hf", options);
    EXPECT_GT(r.files.size(), 1u);
    EXPECT_TRUE(fs::exists(dir / "hf" / "model.safetensors.index.json"));
    EXPECT_TRUE(fs::exists(dir / "hf" / "config.json"));

    auto loaded = MakeZooModel(c, 8);
    ASSERT_NE(Weights(*loaded), Weights(*saved));
    LoadHfWeights(dir / "hf", c, *loaded);
    EXPECT_EQ(Weights(*loaded), Weights(*saved)) << saved->Describe();
    EXPECT_EQ(ConfigDifferences(c, ReadHfConfig(dir / "hf")), std::vector<std::string>{});
  }
}

TEST(HfWeights, Bf16Export_RoundsOnceAndReadsBack) {
  TempDir dir;
  auto saved = MakeZooModel(Llama(), 7);
  const fs::path ckpt = SaveCanonical(*saved, dir / "run", 1);
  ExportOptions options;
  options.dtype = cai_dtype{CAI_DTYPE_BFLOAT, 16, 1};
  ExportSafetensors(ckpt, Llama(), dir / "hf", options);
  ckpt::SafetensorsReader file(dir / "hf" / "model.safetensors");
  EXPECT_EQ(file.Find("lm_head.weight")->dtype.code, CAI_DTYPE_BFLOAT);
  auto loaded = MakeZooModel(Llama(), 8);
  LoadHfWeights(dir / "hf", Llama(), *loaded);
  const auto a = Weights(*saved), b = Weights(*loaded);
  for (const auto& [name, values] : a) {
    for (size_t i = 0; i < values.size(); ++i) {
      ASSERT_NEAR(b.at(name)[i], values[i], std::abs(values[i]) / 128 + 1e-30) << name;
    }
  }
}

// fsdp's sharded layout on 2 ranks, written as plugins/fsdp writes it: one unit of all
// parameters, each rank a shard of the flat parameter, rank 0 the index.
TEST(HfWeights, ExportFromFsdpShardedCheckpoint_AssemblesFullTensors) {
  TempDir dir;
  const ModelConfig c = Gpt2();
  auto saved = MakeZooModel(c, 5);
  std::vector<float> flat;
  std::string index;
  for (uint32_t i = 0; i < saved->NumParams(); ++i) {
    const std::vector<float> w = Floats(saved->ParamData(i));
    index += "param " + std::to_string(flat.size()) + " " + std::to_string(w.size()) + " " +
             saved->ParamInfo(i).name + "\n";
    flat.insert(flat.end(), w.begin(), w.end());
  }
  const int64_t shard = static_cast<int64_t>(flat.size() + 1) / 2;
  flat.resize(static_cast<size_t>(2 * shard), 0.0f);
  index = "fsdp-sharded 1 2\nunit root " + std::to_string(shard) + "\n" + index;
  std::vector<std::unique_ptr<ckpt::CheckpointWriter>> writers;
  for (int r = 1; r >= 0; --r) {
    auto w = std::make_unique<ckpt::CheckpointWriter>(dir / "run", 9, r, 2, "test");
    int64_t n = shard, one = 1;
    cai_tensor t{flat.data() + r * shard, {CAI_DEVICE_CPU, 0}, 1, kF32, &n, &one, 0};
    ThrowIfError(CheckpointApi()->write_tensor(
        w->handle(), ("fsdp/root/param." + std::to_string(r)).c_str(), &t));
    if (r == 0) ThrowIfError(CheckpointApi()->write_meta(w->handle(), "fsdp.index", index.c_str()));
    w->Commit([] {});  // rank 1 first: rank 0 publishes once every file is there
  }
  ExportSafetensors(dir / "run" / "step-000009", c, dir / "hf");
  auto loaded = MakeZooModel(c, 6);
  LoadHfWeights(dir / "hf", c, *loaded);
  EXPECT_EQ(Weights(*loaded), Weights(*saved));
}

TEST(HfWeights, InitFromAnotherModel_RefusedListingTheKeys) {
  TempDir dir;
  auto saved = MakeZooModel(Llama(), 7);
  ExportSafetensors(SaveCanonical(*saved, dir / "run", 1), Llama(), dir / "hf");
  ModelConfig other = Llama();
  other.n_layer = 3;
  other.rope_theta = 10000.0;
  auto m = MakeZooModel(other, 1);
  try {
    LoadHfWeights(dir / "hf", other, *m);
    FAIL() << "loaded weights of another model";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("model.n_layer = 3 (saved: 2)"), std::string::npos) << what;
    EXPECT_NE(what.find("model.rope_theta = 10000.0 (saved: 500000.0)"), std::string::npos) << what;
    EXPECT_NE(what.find("cai import"), std::string::npos) << what;
  }
  // A GPT-2 without biases takes only zero biases.
  TempDir dir2;
  auto biased = MakeZooModel(Gpt2(true), 7);
  for (uint32_t i = 0; i < biased->NumParams(); ++i) {
    const cai_tensor t = biased->ParamData(i);
    if (std::string(biased->ParamInfo(i).name) == "ln_f.bias") static_cast<float*>(t.data)[0] = 1;
  }
  ExportSafetensors(SaveCanonical(*biased, dir2 / "run", 1), Gpt2(true), dir2 / "hf");
  auto unbiased = MakeZooModel(Gpt2(false), 7);
  EXPECT_THROW(LoadHfWeights(dir2 / "hf", Gpt2(false), *unbiased), Error);
}

// cai's loss and gradients on one batch, with targets PyTorch ignores (-100), next to the
// exported weights: HF names and layouts, as torch_reference.py reads them.
void WriteCaiResult(Model& m, const ModelConfig& c, const fs::path& path) {
  constexpr int64_t kB = 2, kT = 12;
  std::vector<int64_t> tokens(kB * kT), targets(kB * kT);
  for (int64_t i = 0; i < kB * kT; ++i) {
    tokens[i] = (i * 7 + 3) % c.vocab_size;
    targets[i] = i % 5 == 4 ? -100 : (i * 11 + 1) % c.vocab_size;
  }
  std::vector<int64_t> shape = {kB, kT}, strides = {kT, 1};
  const cai_tensor tok{tokens.data(), {CAI_DEVICE_CPU, 0}, 2, kI64,
                       shape.data(),  strides.data(),      0};
  const cai_tensor tgt{targets.data(), {CAI_DEVICE_CPU, 0}, 2, kI64,
                       shape.data(),   strides.data(),      0};
  m.ZeroGrad(true);
  const double loss = m.ForwardBackward(tok, tgt, true);

  std::map<std::string, uint32_t> index;
  for (uint32_t i = 0; i < m.NumParams(); ++i) index[m.ParamInfo(i).name] = i;
  std::vector<ckpt::SafetensorsTensor> headers = {
      {"tokens", kI64, shape}, {"targets", kI64, shape}, {"loss", kF64, {}}};
  std::vector<std::vector<char>> data = {
      {reinterpret_cast<char*>(tokens.data()), reinterpret_cast<char*>(tokens.data() + kB * kT)},
      {reinterpret_cast<char*>(targets.data()), reinterpret_cast<char*>(targets.data() + kB * kT)},
      {reinterpret_cast<const char*>(&loss), reinterpret_cast<const char*>(&loss + 1)}};
  for (const HfTensor& t : HfLayout(c)) {
    if (t.cai_name.empty()) continue;
    std::vector<float> g = Floats(m.ParamGrad(index.at(t.cai_name)));
    if (t.transpose) {
      std::vector<float> tr(g.size());
      const int64_t rows = t.shape[1], cols = t.shape[0];  // cai's [out, in]
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t k = 0; k < cols; ++k) tr[k * rows + r] = g[r * cols + k];
      }
      g.swap(tr);
    }
    headers.push_back({"grad." + t.hf_name, kF32, t.shape});
    data.emplace_back(reinterpret_cast<char*>(g.data()),
                      reinterpret_cast<char*>(g.data() + g.size()));
  }
  ckpt::SafetensorsWriter writer(path, headers, {{"format", "pt"}});
  for (const auto& d : data) writer.Append(d.data(), d.size());
  writer.Finish();
}

TEST(HfWeights, PyTorchGpt2AndLlama_ComputeCaiLossAndGradientsWithin1e5) {
  // Debian's python3-torch lives in the system interpreter, which a pyenv may shadow.
  std::string python;
  for (const char* candidate : {"/usr/bin/python3", "python3"}) {
    if (python.empty() &&
        cai::testing::RunCommand(std::string(candidate) + " -c 'import torch'").code == 0) {
      python = candidate;
    }
  }
  if (python.empty()) GTEST_SKIP() << "no python3 with torch (Debian: python3-torch)";
  for (const ModelConfig& c : {Gpt2(true), Llama(false), Llama(true)}) {
    TempDir dir;
    auto m = MakeZooModel(c, 11);
    ExportSafetensors(SaveCanonical(*m, dir / "run", 0), c, dir / "hf");
    WriteCaiResult(*m, c, dir / "cai.safetensors");
    const cai::testing::Result r =
        cai::testing::RunCommand(python + " " + TORCH_REFERENCE + " " + (dir / "hf").string() +
                                 " " + (dir / "cai.safetensors").string());
    std::cout << r.output;  // the largest difference, for the log
    EXPECT_EQ(r.code, 0) << m->Describe() << "\n" << r.output;
    EXPECT_NE(r.output.find("match"), std::string::npos) << r.output;
  }
}

}  // namespace
}  // namespace cai::interop
