#!/usr/bin/env bash
# .ci/neon_tests.sh: cross-builds the scalar + neon kernel sets and their test
# program (simd/testing/neon_test_main.cpp, the checks of tests/test_simd.cpp)
# for AArch64 and runs it under qemu-aarch64.
#
# Needs g++-aarch64-linux-gnu and qemu-user (Debian 12). Run from anywhere;
# writes only under build-neon/ in the repository root (or $BUILD_DIR).
# Exit status: 0 if every check passed, non-zero otherwise.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${BUILD_DIR:-$root/build-neon}"
cxx="${CXX_AARCH64:-aarch64-linux-gnu-g++}"
qemu="${QEMU_AARCH64:-qemu-aarch64}"

for tool in "$cxx" "$qemu"; do
  command -v "$tool" >/dev/null || { echo "neon_tests: $tool not found" >&2; exit 2; }
done

mkdir -p "$build/obj"
flags=(-std=gnu++20 -O2 -Wall -Wextra -I"$root" -DFLCE_SIMD_HAVE_NEON)
# The reference set without FMA contraction, as simd/CMakeLists.txt builds it.
scalar_srcs=("$root"/simd/scalar/*.cpp)
other_srcs=("$root"/simd/dispatch.cpp "$root"/simd/neon/*.cpp "$root"/simd/testing/neon_test_main.cpp)

objs=()
pids=()
compile() {  # src extra-flags...
  local src="$1"; shift
  local obj="$build/obj/$(basename "${src%.cpp}").o"
  objs+=("$obj")
  "$cxx" "${flags[@]}" "$@" -c "$src" -o "$obj" &
  pids+=($!)
}
for src in "${scalar_srcs[@]}"; do compile "$src" -ffp-contract=off; done
for src in "${other_srcs[@]}"; do compile "$src"; done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
if [ "$status" -ne 0 ]; then echo "neon tests: BUILD FAILED" >&2; exit 1; fi

"$cxx" -static -o "$build/neon_tests" "${objs[@]}"
echo "neon_tests: built $build/neon_tests; running under $qemu"
set +e
"$qemu" "$build/neon_tests"
rc=$?
set -e
if [ "$rc" -ne 0 ]; then
  echo "neon tests: FAILED (exit status $rc)"
  exit 1
fi
echo "neon tests: OK"
