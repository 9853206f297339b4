#include <dlfcn.h>

#include <filesystem>
#include <mutex>

#include "core/env.h"
#include "core/status.h"
#include "cuda/cuda_module.h"
#include "loader/file_checks.h"

namespace cai::cuda {
namespace {

// $CAI_CUDA_MODULE, when set and not empty (and never in a setuid process).
const char* ModuleOverride() { return SecureGetenv("CAI_CUDA_MODULE"); }

std::filesystem::path ModulePath() {
  if (const char* path = ModuleOverride()) return path;
  Dl_info info{};
  if (::dladdr(reinterpret_cast<void*>(&Load), &info) == 0 || info.dli_fname == nullptr) {
    // Never a bare name: that would be looked up relative to the working directory.
    throw Error(CAI_UNAVAILABLE,
                "cannot tell where cai's library is, so not where its CUDA module is; set "
                "CAI_CUDA_MODULE to libcai_cuda.so");
  }
  return std::filesystem::path(info.dli_fname).parent_path() / "cai" / "libcai_cuda.so";
}

Module* Open() {
#ifndef CAI_HAVE_CUDA_MODULE
  if (!ModuleOverride()) {
    throw Error(CAI_UNAVAILABLE,
                "this cai was built without CUDA (CMake found no CUDA toolkit with NCCL), so "
                "it cannot take tensors on a CUDA device; rebuild with CUDA and NCCL installed "
                "or keep tensors in host memory");
  }
#endif
  const std::filesystem::path path = ModulePath();
  // The module is code cai runs: checked as plugins are, and loaded from the descriptor that
  // was checked (file_checks.h). RTLD_LOCAL: the CUDA runtime and NCCL stay private to the
  // module; never unloaded, as NCCL's threads may outlive any handle.
  void* handle = nullptr;
  try {
    handle = CheckedFile::Open(path, "the CUDA module's code").Load();
  } catch (const Error& e) {
    if (e.code() == CAI_PERMISSION_DENIED) {
      throw Error(CAI_PERMISSION_DENIED,
                  (ModuleOverride() ? "CAI_CUDA_MODULE=" : "cai's CUDA module ") + path.string() +
                      ": " + e.what());
    }
    throw Error(CAI_UNAVAILABLE,
                "cannot load cai's CUDA module " + std::string(e.what()) +
                    " (install the cai CUDA package, or set CAI_CUDA_MODULE to libcai_cuda.so; "
                    "its CUDA runtime and NCCL must be on the loader's path)");
  }
  auto* create = reinterpret_cast<decltype(&cai_cuda_module_create)>(
      ::dlsym(handle, "cai_cuda_module_create"));
  if (create == nullptr) {
    throw Error(CAI_UNAVAILABLE,
                path.string() + " has no cai_cuda_module_create: not a cai CUDA module");
  }
  Module* module = create(BuildId());
  if (module == nullptr) {
    throw Error(CAI_UNAVAILABLE, path.string() +
                                     " was built from another cai build than this host (" +
                                     BuildId() + "); install the module of the same release");
  }
  return module;
}

}  // namespace

Module& Load() {
  // Loaded at most once; a failure is remembered so every caller gets the same answer.
  static std::once_flag once;
  static Module* module = nullptr;
  static std::string failure;
  static cai_status_code failure_code = CAI_UNAVAILABLE;
  std::call_once(once, [] {
    try {
      module = Open();
    } catch (const Error& e) {
      failure = e.what();
      failure_code = e.code();
    }
  });
  if (module == nullptr) throw Error(failure_code, failure);
  return *module;
}

}  // namespace cai::cuda
