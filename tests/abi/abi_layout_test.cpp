// A frozen ABI minor (tests/abi/v1.N/) must still be a prefix of today's headers: every field
// at the same offset with the same size and type, every constant with the same value, and
// every struct that did not grow in a later minor exactly as large. Checked at compile time:
// if this file builds, the ABI held.
//
// CMake builds it once per frozen minor, defining
//   CAI_FROZEN_NS      namespace the frozen headers are included in (v1_0)
//   CAI_FROZEN_PREFIX  their macros' renamed prefix (CAI_V1_0_)
//   CAI_FROZEN_HEADER  their renamed copy ("cai_v1_0/abi.h")
//   CAI_FROZEN_LAYOUT  the list of their fields, enumerators and flags ("v1_0_layout.inc")
//   CAI_FROZEN_MINOR   their minor (0)
//   CAI_FROZEN_GREW    the structs appended to since, space-separated
// The C headers the ABI includes, first, so that none of them lands inside the namespace.
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <string_view>

#define CAI_CAT_(a, b) a##b
#define CAI_CAT(a, b) CAI_CAT_(a, b)
#define CAI_STR_(x) #x
#define CAI_STR(x) CAI_STR_(x)
// NAME as the frozen headers spell it: CAI_V1_0_NAME.
#define CAI_FROZEN(NAME) CAI_CAT(CAI_FROZEN_PREFIX, NAME)

// The frozen headers, with their macros and entry symbol renamed (CMake generates the copy) so
// that they can sit beside today's in one translation unit. Included first, so that their
// opaque handle types (`typedef struct cai_status cai_status;`) are declared in the namespace
// rather than naming today's global ones.
namespace CAI_FROZEN_NS {
#include CAI_FROZEN_HEADER
// Struct-size macros name their struct unqualified, so each is evaluated in its own namespace.
constexpr size_t kPluginApi = CAI_FROZEN(PLUGIN_API_STRUCT_SIZE);
constexpr size_t kHostApi = CAI_FROZEN(HOST_API_STRUCT_SIZE);
constexpr size_t kModelApi = CAI_FROZEN(MODEL_API_STRUCT_SIZE);
constexpr size_t kOptimApi = CAI_FROZEN(OPTIM_API_STRUCT_SIZE);
constexpr size_t kCommApi = CAI_FROZEN(COMM_API_STRUCT_SIZE);
constexpr size_t kMemApi = CAI_FROZEN(MEM_API_STRUCT_SIZE);
constexpr size_t kCheckpointApi = CAI_FROZEN(CHECKPOINT_API_STRUCT_SIZE);
constexpr size_t kInitArgs = CAI_FROZEN(PLUGIN_INIT_ARGS_STRUCT_SIZE);
}  // namespace CAI_FROZEN_NS

#include "cai/abi.h"

namespace {

namespace frozen = CAI_FROZEN_NS;

template <class T>
constexpr std::string_view TypeName() {
  return __PRETTY_FUNCTION__;
}

// True when the two spellings are equal once the frozen copy's namespace is removed, i.e. the
// types are the same C types.
constexpr bool SameModuloFrozenNamespace(std::string_view frozen, std::string_view current) {
  constexpr std::string_view kNs = CAI_STR(CAI_FROZEN_NS) "::";
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

constexpr bool GrewSinceFrozen(std::string_view name) {
  constexpr std::string_view kGrew = CAI_FROZEN_GREW;
  for (size_t at = kGrew.find(name); at != std::string_view::npos; at = kGrew.find(name, at + 1)) {
    const size_t end = at + name.size();
    if ((at == 0 || kGrew[at - 1] == ' ') && (end == kGrew.size() || kGrew[end] == ' ')) {
      return true;
    }
  }
  return false;
}

#define CAI_FROZEN_FIELD(S, f)                                                      \
  static_assert(offsetof(frozen::S, f) == offsetof(::S, f), #S "." #f " moved");    \
  static_assert(sizeof(frozen::S::f) == sizeof(::S::f), #S "." #f " changed size"); \
  static_assert(SameType<decltype(frozen::S::f), decltype(::S::f)>(), #S "." #f " changed type");
#define CAI_FROZEN_STRUCT(S)                                                                    \
  static_assert(                                                                                \
      GrewSinceFrozen(#S) ? sizeof(frozen::S) < sizeof(::S) : sizeof(frozen::S) == sizeof(::S), \
      #S " changed size");
#define CAI_FROZEN_ENUM(NAME)                                                                 \
  static_assert(                                                                              \
      static_cast<long long>(frozen::CAI_FROZEN(NAME)) == static_cast<long long>(CAI_##NAME), \
      "CAI_" #NAME " changed value");
#define CAI_FROZEN_FLAG(NAME) \
  static_assert(CAI_FROZEN(NAME) == CAI_##NAME, "CAI_" #NAME " changed value");

#include CAI_FROZEN_LAYOUT

#define CAI_FROZEN_SIZE(k, S, current)                                               \
  static_assert(GrewSinceFrozen(#S) ? frozen::k < current : frozen::k == current, #S \
                "'s size "                                                           \
                "macro changed");
CAI_FROZEN_SIZE(kPluginApi, cai_plugin_api, CAI_PLUGIN_API_STRUCT_SIZE)
CAI_FROZEN_SIZE(kHostApi, cai_host_api, CAI_HOST_API_STRUCT_SIZE)
CAI_FROZEN_SIZE(kModelApi, cai_model_api, CAI_MODEL_API_STRUCT_SIZE)
CAI_FROZEN_SIZE(kOptimApi, cai_optim_api, CAI_OPTIM_API_STRUCT_SIZE)
CAI_FROZEN_SIZE(kCommApi, cai_comm_api, CAI_COMM_API_STRUCT_SIZE)
CAI_FROZEN_SIZE(kMemApi, cai_mem_api, CAI_MEM_API_STRUCT_SIZE)
CAI_FROZEN_SIZE(kCheckpointApi, cai_checkpoint_api, CAI_CHECKPOINT_API_STRUCT_SIZE)
CAI_FROZEN_SIZE(kInitArgs, cai_plugin_init_args, CAI_PLUGIN_INIT_ARGS_STRUCT_SIZE)
static_assert(CAI_FROZEN(ABI_MAJOR) == CAI_ABI_MAJOR);
static_assert(CAI_FROZEN(ABI_MINOR) == CAI_FROZEN_MINOR && CAI_ABI_MINOR > CAI_FROZEN_MINOR);
#if CAI_FROZEN_MINOR == 0
// Hosts read a 1.0 plugin's table up to this size.
static_assert(frozen::kPluginApi == CAI_PLUGIN_API_V1_0_STRUCT_SIZE);
#endif

}  // namespace

int main() { return 0; }
