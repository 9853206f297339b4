// The optimizer service through its ABI table, as a plugin sees it.
#include "optim/optim_api.h"

#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "cai/optimizer.h"
#include "core/status.h"
#include "mem/float16.h"
#include "optim/optimizer.h"

namespace cai {
namespace {

std::pair<cai_status_code, std::string> Take(cai_status* s) {
  std::pair<cai_status_code, std::string> r{StatusCode(s), StatusMessage(s)};
  DestroyStatus(s);
  return r;
}

constexpr cai_dtype kF32{CAI_DTYPE_FLOAT, 32, 1};
constexpr cai_dtype kBf16{CAI_DTYPE_BFLOAT, 16, 1};

class OptimApiTest : public ::testing::Test {
 protected:
  OptimApiTest() {
    GroupHyper h;
    h.lr = 1e-2;
    h.weight_decay = 0.1;
    opt_ = std::make_unique<Optimizer>(CAI_OPTIM_ADAMW, DefaultParamGroups(h),
                                       LrSchedule{2, 10, 0.0}, 1.0);
  }
  cai_optimizer* handle() { return ToHandle(opt_.get()); }

  cai_optim_update_args Args(std::vector<float>& p, const void* grad, cai_dtype grad_dtype,
                             std::vector<float>& m, std::vector<float>& v) {
    cai_optim_update_args a{};
    a.struct_size = CAI_OPTIM_UPDATE_ARGS_STRUCT_SIZE;
    a.optimizer = handle();
    a.group = 0;
    a.param = p.data();
    a.grad = grad;
    a.grad_dtype = grad_dtype;
    a.state[0] = m.data();
    a.state[1] = v.data();
    a.numel = p.size();
    a.step = 1;
    a.lr = api->lr_at(handle(), 0, 1);
    a.grad_scale = 1;
    a.device = {CAI_DEVICE_CPU, 0};
    return a;
  }

  const cai_optim_api* api = OptimApi();
  std::unique_ptr<Optimizer> opt_;
};

TEST_F(OptimApiTest, Table_IsFullyFilled) {
  EXPECT_EQ(api->struct_size, CAI_OPTIM_API_STRUCT_SIZE);
  EXPECT_TRUE(api->num_groups && api->group_info && api->update && api->lr_at &&
              api->clip_coefficient && api->max_grad_norm && api->loss_scaler_create &&
              api->loss_scaler_destroy && api->loss_scaler_scale && api->loss_scaler_update &&
              api->loss_scaler_get_state && api->loss_scaler_set_state);
}

TEST_F(OptimApiTest, GroupsScheduleAndClip_ReportTheOptimizer) {
  EXPECT_EQ(api->num_groups(handle()), 2u);
  EXPECT_EQ(api->num_groups(nullptr), 0u);
  cai_optim_group_info info{};
  info.struct_size = CAI_OPTIM_GROUP_INFO_STRUCT_SIZE;
  ASSERT_EQ(api->group_info(handle(), 1, &info), nullptr);
  EXPECT_EQ(info.kind, CAI_OPTIM_ADAMW);
  EXPECT_EQ(info.lr, 1e-2);
  EXPECT_EQ(info.weight_decay, 0.0);
  EXPECT_EQ(info.beta2, 0.999);
  EXPECT_EQ(info.state_slots, 2u);
  EXPECT_EQ(Take(api->group_info(handle(), 2, &info)).first, CAI_OUT_OF_RANGE);
  info.struct_size = 8;
  EXPECT_EQ(Take(api->group_info(handle(), 0, &info)).first, CAI_INVALID_ARGUMENT);

  EXPECT_DOUBLE_EQ(api->lr_at(handle(), 0, 1), 5e-3);
  EXPECT_DOUBLE_EQ(api->lr_at(handle(), 0, 10), 0.0);
  EXPECT_TRUE(std::isnan(api->lr_at(handle(), 5, 1)));
  EXPECT_EQ(api->max_grad_norm(handle()), 1.0);
  EXPECT_DOUBLE_EQ(api->clip_coefficient(handle(), 3.0), 1.0 / (3.0 + 1e-6));
  EXPECT_EQ(api->clip_coefficient(handle(), 0.25), 1.0);
}

TEST_F(OptimApiTest, UpdateWithBf16GradsAndLowpOut_MatchesCppUpdate) {
  std::vector<float> p(1000, 0.5f), m(1000), v(1000), p2 = p, m2 = m, v2 = v;
  std::vector<uint16_t> grad(1000), lowp(1000);
  for (size_t i = 0; i < grad.size(); ++i) grad[i] = FloatToBf16(std::sin(static_cast<float>(i)));
  cai_optim_update_args a = Args(p, grad.data(), kBf16, m, v);
  a.param_lowp = lowp.data();
  a.param_lowp_dtype = kBf16;
  a.grad_scale = 0.5;
  ASSERT_EQ(api->update(&a), nullptr);

  FusedUpdate u;
  u.param = p2.data();
  u.grad = grad.data();
  u.grad_type = FloatType::kBF16;
  u.state[0] = m2.data();
  u.state[1] = v2.data();
  u.numel = 1000;
  u.lr = a.lr;
  u.grad_scale = 0.5;
  opt_->Update(0, u);
  EXPECT_EQ(p, p2);
  EXPECT_EQ(m, m2);
  EXPECT_EQ(lowp[7], FloatToBf16(p[7]));
  EXPECT_NE(p[7], 0.5f);
}

TEST_F(OptimApiTest, BadUpdateArguments_AreInvalidArgumentsWithReasons) {
  std::vector<float> p(8), g(8), m(8), v(8);
  cai_optim_update_args a = Args(p, g.data(), kF32, m, v);
  a.struct_size = 16;
  EXPECT_EQ(Take(api->update(&a)).first, CAI_INVALID_ARGUMENT);
  EXPECT_EQ(Take(api->update(nullptr)).first, CAI_INVALID_ARGUMENT);

  a = Args(p, g.data(), cai_dtype{CAI_DTYPE_INT, 32, 1}, m, v);
  auto [code, msg] = Take(api->update(&a));
  EXPECT_EQ(code, CAI_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("grad dtype"), std::string::npos) << msg;

  a = Args(p, g.data(), kF32, m, v);
  a.state[1] = nullptr;
  std::tie(code, msg) = Take(api->update(&a));
  EXPECT_EQ(code, CAI_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("state slot 1"), std::string::npos) << msg;

  a = Args(p, g.data(), kF32, m, v);
  a.param_lowp = m.data();
  a.param_lowp_dtype = kF32;
  EXPECT_EQ(Take(api->update(&a)).first, CAI_INVALID_ARGUMENT);

  // CUDA memory goes to the CUDA module (tests/host/cuda); a device type nobody takes does not.
  a = Args(p, g.data(), kF32, m, v);
  a.device = {10, 0};
  EXPECT_EQ(Take(api->update(&a)).first, CAI_INVALID_ARGUMENT);

  a = Args(p, g.data(), kF32, m, v);
  a.optimizer = nullptr;
  EXPECT_EQ(Take(api->update(&a)).first, CAI_INVALID_ARGUMENT);
  a = Args(p, g.data(), kF32, m, v);
  a.group = 9;
  EXPECT_EQ(Take(api->update(&a)).first, CAI_OUT_OF_RANGE);
  EXPECT_EQ(p, std::vector<float>(8));  // nothing was touched by the failed calls
}

TEST_F(OptimApiTest, LossScaler_CreateUpdateAndRestoreState) {
  cai_loss_scaler_config c{};
  c.struct_size = CAI_LOSS_SCALER_CONFIG_STRUCT_SIZE;
  c.initial_scale = 65536;
  c.growth_factor = 2;
  c.backoff_factor = 0.5;
  c.growth_interval = 2;
  c.hysteresis = 2;
  c.min_scale = 1;
  c.max_scale = 0;  // no upper clamp
  cai_loss_scaler* s = nullptr;
  ASSERT_EQ(api->loss_scaler_create(&c, &s), nullptr);
  EXPECT_FALSE(api->loss_scaler_update(s, false));
  EXPECT_FALSE(api->loss_scaler_update(s, false));
  EXPECT_EQ(api->loss_scaler_scale(s), 131072);
  EXPECT_TRUE(api->loss_scaler_update(s, true));
  EXPECT_EQ(api->loss_scaler_scale(s), 131072);  // hysteresis 2 tolerates one
  EXPECT_TRUE(api->loss_scaler_update(s, true));
  EXPECT_EQ(api->loss_scaler_scale(s), 65536);

  cai_loss_scaler_state st{};
  st.struct_size = CAI_LOSS_SCALER_STATE_STRUCT_SIZE;
  ASSERT_EQ(api->loss_scaler_get_state(s, &st), nullptr);
  EXPECT_EQ(st.scale, 65536);
  EXPECT_EQ(st.clean_steps, 0);
  EXPECT_EQ(st.overflows_left, 0);

  cai_loss_scaler* restored = nullptr;
  ASSERT_EQ(api->loss_scaler_create(&c, &restored), nullptr);
  ASSERT_EQ(api->loss_scaler_set_state(restored, &st), nullptr);
  EXPECT_TRUE(api->loss_scaler_update(restored, true));
  EXPECT_EQ(api->loss_scaler_scale(restored), 32768);

  st.overflows_left = 5;
  EXPECT_EQ(Take(api->loss_scaler_set_state(restored, &st)).first, CAI_INVALID_ARGUMENT);
  c.struct_size = 8;
  cai_loss_scaler* untouched = nullptr;
  EXPECT_EQ(Take(api->loss_scaler_create(&c, &untouched)).first, CAI_INVALID_ARGUMENT);
  EXPECT_EQ(untouched, nullptr);
  api->loss_scaler_destroy(s);
  api->loss_scaler_destroy(restored);
  api->loss_scaler_destroy(nullptr);
}

}  // namespace
}  // namespace cai
