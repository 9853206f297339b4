# cai_add_plugin(<target> <sources>...): builds a cai strategy plugin as a shared object that
# exports only cai_plugin_init_v1 (hidden visibility + version script), links no LibTorch,
# CUDA runtime or communication library, and resolves every symbol at link time.
function(cai_add_plugin target)
  set(_CAI_PLUGIN_MAP ${CMAKE_CURRENT_FUNCTION_LIST_DIR}/cai_plugin.map)
  add_library(${target} MODULE ${ARGN})
  target_link_libraries(${target} PRIVATE cai::sdk)
  set_target_properties(${target} PROPERTIES
    PREFIX "lib"
    C_VISIBILITY_PRESET hidden
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON
    LINK_DEPENDS ${_CAI_PLUGIN_MAP})
  target_link_options(${target} PRIVATE
    -Wl,--version-script=${_CAI_PLUGIN_MAP} -Wl,--no-undefined -Wl,-z,now)
endfunction()
