# Sourced by the script tests first: strict mode, the repository root (ROOT), a scratch folder removed on
# exit (TMP), fail MESSAGE, which ends the test with it, and commit_scratch_repo for the build scripts' tests.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
# commit_scratch_repo DIR: DIR (holding scripts/gpu-check, a stand-in for the real build) as a git
# repository: the stand-in executable, build-gpu/ ignored, kernels/k.cu reading "kernel", every file committed.
commit_scratch_repo() {
  chmod +x "$1/scripts/gpu-check"
  printf '/build-gpu/\n' > "$1/.gitignore"
  mkdir -p "$1/kernels" && echo "kernel" > "$1/kernels/k.cu"
  (cd "$1" && git init -q && git add -A && git -c user.name=t -c user.email=t@t commit -qm base)
}
