// ABI 1.0 as frozen under tests/abi/v1.0/ must still be a prefix of today's headers: every
// field at the same offset with the same size and type, every constant with the same value,
// and every struct that did not grow in a later minor exactly as large. Checked at compile
// time: if this file builds, the ABI held.
// The C headers the ABI includes, first, so that none of them lands inside namespace v1_0.
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <string_view>

// The frozen headers, with their macros and entry symbol renamed (CMake generates the copy) so
// that they can sit beside today's in one translation unit. Included first, so that their
// opaque handle types (`typedef struct cai_status cai_status;`) are declared in v1_0 rather
// than naming today's global ones.
namespace v1_0 {
#include "cai_v1_0/abi.h"
// Struct-size macros name their struct unqualified, so each is evaluated in its own namespace.
constexpr size_t kPluginApi = CAI_V1_0_PLUGIN_API_STRUCT_SIZE;
constexpr size_t kHostApi = CAI_V1_0_HOST_API_STRUCT_SIZE;
constexpr size_t kModelApi = CAI_V1_0_MODEL_API_STRUCT_SIZE;
constexpr size_t kOptimApi = CAI_V1_0_OPTIM_API_STRUCT_SIZE;
constexpr size_t kCommApi = CAI_V1_0_COMM_API_STRUCT_SIZE;
constexpr size_t kMemApi = CAI_V1_0_MEM_API_STRUCT_SIZE;
constexpr size_t kCheckpointApi = CAI_V1_0_CHECKPOINT_API_STRUCT_SIZE;
constexpr size_t kInitArgs = CAI_V1_0_PLUGIN_INIT_ARGS_STRUCT_SIZE;
}  // namespace v1_0

#include "cai/abi.h"

namespace {

template <class T>
constexpr std::string_view TypeName() {
  return __PRETTY_FUNCTION__;
}

// True when the two spellings are equal once the frozen copy's namespace is removed, i.e. the
// types are the same C types.
constexpr bool SameModuloFrozenNamespace(std::string_view frozen, std::string_view current) {
  constexpr std::string_view kNs = "v1_0::";
  size_t j = 0;
  for (size_t i = 0; i < frozen.size();) {
    if (frozen.substr(i, kNs.size()) == kNs) {
      i += kNs.size();
      continue;
    }
    if (j >= current.size() || frozen[i] != current[j]) return false;
    ++i;
    ++j;
  }
  return j == current.size();
}

template <class Frozen, class Current>
constexpr bool SameType() {
  return SameModuloFrozenNamespace(TypeName<Frozen>(), TypeName<Current>());
}

#define CAI_FROZEN_FIELD(S, f)                                                    \
  static_assert(offsetof(v1_0::S, f) == offsetof(::S, f), #S "." #f " moved");    \
  static_assert(sizeof(v1_0::S::f) == sizeof(::S::f), #S "." #f " changed size"); \
  static_assert(SameType<decltype(v1_0::S::f), decltype(::S::f)>(), #S "." #f " changed type");
// Only the strategy table grew (1.1: estimate_memory); every other struct is unchanged.
constexpr bool GrewSince1_0(std::string_view name) { return name == "cai_plugin_api"; }
#define CAI_FROZEN_STRUCT(S)                                                                       \
  static_assert(GrewSince1_0(#S) ? sizeof(v1_0::S) < sizeof(::S) : sizeof(v1_0::S) == sizeof(::S), \
                #S " changed size");
#define CAI_FROZEN_ENUM(NAME)                                                              \
  static_assert(                                                                           \
      static_cast<long long>(v1_0::CAI_V1_0_##NAME) == static_cast<long long>(CAI_##NAME), \
      "CAI_" #NAME " changed value");
#define CAI_FROZEN_FLAG(NAME) \
  static_assert(CAI_V1_0_##NAME == CAI_##NAME, "CAI_" #NAME " changed value");

#include "v1_0_layout.inc"

static_assert(v1_0::kPluginApi == CAI_PLUGIN_API_V1_0_STRUCT_SIZE);
static_assert(v1_0::kPluginApi < CAI_PLUGIN_API_STRUCT_SIZE);
static_assert(CAI_V1_0_ABI_MAJOR == CAI_ABI_MAJOR);
static_assert(CAI_V1_0_ABI_MINOR == 0 && CAI_ABI_MINOR >= 1);
static_assert(v1_0::kHostApi == CAI_HOST_API_STRUCT_SIZE);
static_assert(v1_0::kModelApi == CAI_MODEL_API_STRUCT_SIZE);
static_assert(v1_0::kOptimApi == CAI_OPTIM_API_STRUCT_SIZE);
static_assert(v1_0::kCommApi == CAI_COMM_API_STRUCT_SIZE);
static_assert(v1_0::kMemApi == CAI_MEM_API_STRUCT_SIZE);
static_assert(v1_0::kCheckpointApi == CAI_CHECKPOINT_API_STRUCT_SIZE);
static_assert(v1_0::kInitArgs == CAI_PLUGIN_INIT_ARGS_STRUCT_SIZE);

}  // namespace

int main() { return 0; }
