#!/usr/bin/env bash
# The kernel candidates kept as patches (scripts/gpu/candidates) still apply to this tree, as ab-bench
# --variant NAME=PATCH will lay them (tree-overlay from-patch), and change only kernels/ (with, for a
# kernel's new input, its caller in core/attention/ and its GPU tests in tests/gpu/, and for a new path
# switch, bench gdn's alternation in app/cli/cmd_bench_gdn.cpp, and the text under docs/ that landing it changes,
# which no build reads); the folder's
# README has a row for each patch and none for a patch that is not there. A kernel change that leaves a
# candidate stale fails here, so that the candidate is brought up to date or dropped with it.
source "$(dirname "$0")/preamble.sh"
cd "$ROOT"
shopt -s nullglob
patches=(scripts/gpu/candidates/*.patch)
readme=scripts/gpu/candidates/README.md
# What is wrong with patch P laid out in folder D (nothing printed: a candidate's files).
wrong_files() {
  local others
  others=$(cd "$2" && find . -type f ! -path './kernels/*' ! -path './core/attention/*' ! -path './tests/gpu/*' \
    ! -path './app/cli/cmd_bench_gdn.cpp' ! -path './docs/*.md')
  if [[ -n "$others" ]]; then echo "$1 changes files outside kernels/, core/attention/, tests/gpu/, bench gdn's source and docs/*.md: $others"
  elif [[ -z "$(cd "$2" && find ./kernels -type f 2>/dev/null)" ]]; then echo "$1 changes no kernel"; fi
}
for p in "${patches[@]}"; do
  name=$(basename "$p" .patch)
  err=$(scripts/gpu/tree-overlay from-patch "$p" "$TMP/$name" 2>&1) || fail "$p: $err"
  err=$(wrong_files "$p" "$TMP/$name")
  [[ -z "$err" ]] || fail "$err"
  grep -q "^| \`$name.patch\` |" "$readme" || fail "$readme has no row for $name.patch"
done
# The rule on files refuses a patch that reaches elsewhere (another file of the CLI's or a script too), and one
# without a kernel; it takes bench gdn's source and a Markdown file under docs/ beside a kernel.
new_file() { printf 'diff --git a/%s b/%s\nnew file mode 100644\n--- /dev/null\n+++ b/%s\n@@ -0,0 +1 @@\n+x\n' "$1" "$1" "$1"; }
{ new_file kernels/probe.cu; new_file README.probe; } > "$TMP/elsewhere.patch"
{ new_file kernels/probe.cu; new_file app/cli/cmd_probe.cpp; } > "$TMP/other-cli.patch"
{ new_file kernels/probe.cu; new_file scripts/gpu/probe; } > "$TMP/script.patch"
{ new_file kernels/probe.cu; new_file docs/PROBE.md; } > "$TMP/docs.patch"
scripts/gpu/tree-overlay from-patch "$TMP/docs.patch" "$TMP/probe-docs" > /dev/null 2>&1 || fail "the probe docs does not apply"
[[ -z "$(wrong_files docs "$TMP/probe-docs")" ]] || fail "the rule on files refuses docs/*.md: $(wrong_files docs "$TMP/probe-docs")"
new_file tests/gpu/probe.cpp > "$TMP/no-kernel.patch"
# A kernel and one more line at the end of bench gdn's source.
cp app/cli/cmd_bench_gdn.cpp "$TMP/bench-copy.cpp" && echo "// probe" >> "$TMP/bench-copy.cpp"
{ new_file kernels/probe.cu
  diff -u --label a/app/cli/cmd_bench_gdn.cpp --label b/app/cli/cmd_bench_gdn.cpp app/cli/cmd_bench_gdn.cpp "$TMP/bench-copy.cpp" || (($? == 1))  # (1: they differ)
} > "$TMP/bench.patch"
scripts/gpu/tree-overlay from-patch "$TMP/bench.patch" "$TMP/probe-bench" > /dev/null 2>&1 || fail "the probe bench does not apply"
[[ -z "$(wrong_files bench "$TMP/probe-bench")" ]] || fail "the rule on files refuses bench gdn's source: $(wrong_files bench "$TMP/probe-bench")"
for bad in elsewhere:"outside kernels/" other-cli:"outside kernels/" script:"outside kernels/" no-kernel:"changes no kernel"; do
  name=${bad%%:*}
  scripts/gpu/tree-overlay from-patch "$TMP/$name.patch" "$TMP/probe-$name" > /dev/null 2>&1 || fail "the probe $name does not apply"
  [[ "$(wrong_files "$name" "$TMP/probe-$name")" == *"${bad#*:}"* ]] || fail "the rule on files let $name.patch through"
done
while read -r listed; do
  [[ -f "scripts/gpu/candidates/$listed" ]] || fail "$readme lists $listed, which is not there"
done < <(grep -o '^| `[^`]*\.patch` |' "$readme" | sed 's/^| `//; s/` |$//')
echo "kernel candidates: ${#patches[@]} apply"
