# Sourced by the script tests first: strict mode, the repository root (ROOT), a scratch folder removed on
# exit (TMP) and fail MESSAGE, which ends the test with it.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
