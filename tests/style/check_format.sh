#!/usr/bin/env bash
# Every C and C++ source of cai is laid out as .clang-format says. The frozen ABI
# header sets are exempt: they are never edited, not even to reformat them.
# usage: check_format.sh SOURCE_DIR
set -euo pipefail
cd "$1"
mapfile -t files < <(find abi host sdk plugins tests bench -type f \
  \( -name '*.h' -o -name '*.hpp' -o -name '*.c' -o -name '*.cpp' -o -name '*.cu' \) ! -path 'tests/abi/v1.*/*' | sort)
bad=()
for f in "${files[@]}"; do
  clang-format --dry-run --Werror "$f" >/dev/null 2>&1 || bad+=("$f")
done
if ((${#bad[@]})); then
  echo "not clang-formatted (run: clang-format -i ${bad[*]}):"
  printf '  %s\n' "${bad[@]}"
  exit 1
fi
echo "${#files[@]} files formatted"
