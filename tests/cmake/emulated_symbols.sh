#!/usr/bin/env bash
# ctest avx512_emulated_symbols: every symbol that the emulated AVX-512
# library (flce_simd_avx512_emulated, tests/CMakeLists.txt) defines for the
# linker is a renamed kernel (..._emulated), the set's accessor, the
# model's own (avx512_emulation::) or the unwinder's (DW.ref.*). A kernel
# left out of the renaming list would otherwise link silently: the emulated
# set calling flce_simd's real AVX-512 code (SIGILL without AVX-512), or
# the real set the emulated copy.
# Usage: emulated_symbols.sh LIBRARY.a
set -euo pipefail
lib=$1
defined=$(nm -gC --defined-only "$lib" | grep -E '^[0-9a-f]+ [A-Za-z] ' | cut -d' ' -f3-)
[ -n "$defined" ] || { echo "no symbols read from $lib"; exit 1; }
stray=$(printf '%s\n' "$defined" |
        grep -v -E '_emulated\(|^flce::simd::testing::avx512_emulated_kernels\(\)|avx512_emulation::|^DW\.ref\.' || true)
if [ -n "$stray" ]; then
  echo "$lib defines symbols that are not renamed (add them to FLCE_AVX512_KERNEL_NAMES):"
  printf '%s\n' "$stray" | sort -u
  exit 1
fi
echo "$(printf '%s\n' "$defined" | grep -c '_emulated(') renamed kernel symbols, nothing else but the model's"
