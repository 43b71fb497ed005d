# Shared by scripts/run and scripts/test: install what the build needs, then configure and build.
# shellcheck shell=bash
set -euo pipefail

HH_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HH_BUILD_DIR="${HH_BUILD_DIR:-$HH_ROOT/build}"

# Debian 12 packages (DESIGN §11). nodejs/npm only fetch and run the reference tokenizer in tests.
# libopenblas0-pthread takes over libblas.so.3 (update-alternatives) from the reference BLAS that
# libtorch-dev pulls in: CPU matmuls get 10-16x faster (docs/BENCHMARKS.md).
HH_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  libtorch-dev libgloo-dev libopenblas0-pthread libhdf5-dev libgtest-dev libgmock-dev nlohmann-json3-dev
  libcli11-dev libpcre2-dev libbenchmark-dev
  qt6-base-dev qt6-svg-dev libqcustomplot-dev libqcustomplot2.1-qt6 libgl-dev
  clang libclang-rt-14-dev
  python3 python3-h5py python3-numpy
)

hh_log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }

hh_install_packages() {
  local missing=()
  for p in "${HH_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ! command -v node >/dev/null || ! command -v npm >/dev/null; then missing+=(nodejs npm); fi
  if ((${#missing[@]} == 0)); then return 0; fi
  hh_log "installing Debian packages: ${missing[*]}"
  local sudo=""
  if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -q
  $sudo apt-get install -y -q --no-install-recommends "${missing[@]}"
}

hh_jobs() { nproc 2>/dev/null || echo 2; }

# hh_build [extra cmake args...]: configure (once) and build everything in $HH_BUILD_DIR.
hh_build() {
  local start=$SECONDS
  hh_log "configuring $HH_BUILD_DIR"
  cmake -S "$HH_ROOT" -B "$HH_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
  hh_log "building with $(hh_jobs) jobs"
  cmake --build "$HH_BUILD_DIR" -j "$(hh_jobs)"
  hh_log "build finished in $((SECONDS - start)) s"
}
