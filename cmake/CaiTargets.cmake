# Shared build settings for cai's own targets.

# Warnings as errors on our code only (never on third-party headers, which come in as SYSTEM).
add_library(cai_warnings INTERFACE)
target_compile_options(cai_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:C,CXX>:-Wall -Wextra -Werror>)
if(CAI_SANITIZE)
  # GCC's flow warnings misfire on sanitizer-instrumented code (its manual says so for
  # -Wmaybe-uninitialized, and libstdc++'s <regex> trips it): the plain build keeps them.
  target_compile_options(cai_warnings INTERFACE
    $<$<COMPILE_LANGUAGE:C,CXX>:-Wno-maybe-uninitialized -Wno-error=stringop-overflow -Wno-error=array-bounds>)
endif()

find_package(spdlog REQUIRED)
find_package(tomlplusplus REQUIRED)

# LibTorch, found once. Debian ships it under the multiarch cmake dir; a CUDA LibTorch 2.x is
# used by passing -DCMAKE_PREFIX_PATH=/path/to/libtorch.
set(CAI_TORCH_FOUND OFF)
find_package(Torch QUIET)
if(Torch_FOUND)
  set(CAI_TORCH_FOUND ON)
  # Torch's imported targets carry its include dirs; mark them SYSTEM so -Werror stays ours.
  add_library(cai_torch INTERFACE)
  target_link_libraries(cai_torch INTERFACE ${TORCH_LIBRARIES})
  get_target_property(_torch_inc torch INTERFACE_INCLUDE_DIRECTORIES)
  if(_torch_inc)
    target_include_directories(cai_torch SYSTEM INTERFACE ${_torch_inc})
  endif()
  # One precompiled <torch/torch.h> shared by every LibTorch translation unit (~25 s each
  # without it). Targets opt in with cai_use_torch().
  add_library(cai_torch_pch STATIC ${CMAKE_CURRENT_LIST_DIR}/torch_pch.cpp)
  target_link_libraries(cai_torch_pch PUBLIC cai_torch PRIVATE cai_warnings)
  target_precompile_headers(cai_torch_pch PRIVATE <torch/torch.h>)
endif()

# Links a target against LibTorch and reuses the shared precompiled header.
function(cai_use_torch target)
  if(NOT CAI_TORCH_FOUND)
    message(FATAL_ERROR "${target} needs LibTorch: install libtorch-dev (scripts/setup.sh) or "
                        "pass -DCMAKE_PREFIX_PATH=<libtorch prefix>")
  endif()
  target_link_libraries(${target} PRIVATE cai_torch cai_warnings)
  target_precompile_headers(${target} REUSE_FROM cai_torch_pch)
  # The shared header is compiled -fPIC (for libraries); GCC refuses it for a -fPIE
  # translation unit, so executables compile -fPIC too (harmless: the link stays PIE).
  get_target_property(_type ${target} TYPE)
  if(_type STREQUAL "EXECUTABLE")
    target_compile_options(${target} PRIVATE -fPIC)
  endif()
endfunction()
