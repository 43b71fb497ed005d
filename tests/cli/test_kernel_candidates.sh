#!/usr/bin/env bash
# The kernel candidates kept as patches (scripts/gpu/candidates) still apply to this tree, as ab-bench
# --variant NAME=PATCH will lay them (tree-overlay from-patch), and change only kernels/ (with, for a
# kernel's new input, its caller in core/attention/ and its GPU tests in tests/gpu/); the folder's
# README has a row for each patch and none for a patch that is not there. A kernel change that leaves a
# candidate stale fails here, so that the candidate is brought up to date or dropped with it.
source "$(dirname "$0")/preamble.sh"
cd "$ROOT"
shopt -s nullglob
patches=(scripts/gpu/candidates/*.patch)
readme=scripts/gpu/candidates/README.md
for p in "${patches[@]}"; do
  name=$(basename "$p" .patch)
  err=$(scripts/gpu/tree-overlay from-patch "$p" "$TMP/$name" 2>&1) || fail "$p: $err"
  others=$(cd "$TMP/$name" && find . -type f ! -path './kernels/*' ! -path './core/attention/*' ! -path './tests/gpu/*')
  [[ -z "$others" ]] || fail "$p changes files outside kernels/, core/attention/ and tests/gpu/: $others"
  [[ -n "$(cd "$TMP/$name" && find ./kernels -type f 2>/dev/null)" ]] || fail "$p changes no kernel"
  grep -q "^| \`$name.patch\` |" "$readme" || fail "$readme has no row for $name.patch"
done
while read -r listed; do
  [[ -f "scripts/gpu/candidates/$listed" ]] || fail "$readme lists $listed, which is not there"
done < <(grep -o '^| `[^`]*\.patch` |' "$readme" | sed 's/^| `//; s/` |$//')
echo "kernel candidates: ${#patches[@]} apply"
