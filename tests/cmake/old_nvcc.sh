#!/usr/bin/env bash
# An nvcc older than 12 (here the real one, saying it is 11.8 when asked its
# version): FLCE_CUDA=AUTO configures without the cuda backend and says why,
# FLCE_CUDA=ON stops. Exits 77 (skipped) where there is no nvcc to wrap.
#   bash tests/cmake/old_nvcc.sh SOURCE_DIR [NVCC]
# NVCC: the one CMake found, else nvcc on PATH (Debian's own toolkit, 11.8,
# is /usr/bin/nvcc), else /usr/local/cuda/bin/nvcc.
set -uo pipefail
src=$1 nvcc=${2:-}
[[ -n $nvcc ]] || nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
[[ -x $nvcc ]] || { echo "no nvcc at $nvcc: skipped"; exit 77; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat > "$work/nvcc" <<WRAP
#!/bin/sh
if [ "\$1" = "--version" ]; then echo "Cuda compilation tools, release 11.8, V11.8.89"; exit 0; fi
exec "$nvcc" "\$@"
WRAP
chmod +x "$work/nvcc"
configure() {  # FLCE_CUDA value, build dir: cmake's output
  CUDACXX="$work/nvcc" cmake -S "$src" -B "$work/$2" -G Ninja -DFLCE_CUDA="$1" \
    -DFLCE_BUILD_TESTS=OFF -DFLCE_BUILD_BENCH=OFF -DFLCE_BUILD_EXAMPLES=OFF 2>&1
}
status=0
auto=$(configure AUTO auto); auto_rc=$?
echo "$auto" | grep -i cuda
[[ $auto_rc == 0 ]] || { echo "FAIL: AUTO did not configure"; status=1; }
echo "$auto" | grep -q "is CUDA 11.8, and the cuda backend needs 12.0 or newer for sm_90a: building without it" \
  || { echo "FAIL: AUTO did not say why it left the backend out"; status=1; }
on=$(configure ON on); on_rc=$?
echo "$on" | grep -A2 "CMake Error"
[[ $on_rc != 0 ]] || { echo "FAIL: ON configured"; status=1; }
echo "$on" | grep -q "FLCE_CUDA=ON but" || { echo "FAIL: ON did not say why it stopped"; status=1; }
exit $status
