# Sourced by scripts/build.sh and packaging/tests/package_test.sh: ccache may reuse objects
# compiled against the shared precompiled <torch/torch.h>, and objects compiled in another
# build directory of the same sources at the same depth (paths relative to the checkout).
# usage: source scripts/ccache-env.sh SOURCE_DIR
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
export CCACHE_BASEDIR=$1 CCACHE_NOHASHDIR=1
