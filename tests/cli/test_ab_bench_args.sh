#!/usr/bin/env bash
# scripts/gpu/ab-bench's options, checked before it builds anything (no CUDA needed): --help prints its
# usage; a run count that is not a positive number, a base folder that is not there, a revision that is
# not a commit, a variant that is not NAME=DIR with a folder or NAME=PATCH with a patch that applies
# here (or whose name is taken), --base-tree or --tests-variants without variants, --base-tree beside
# --base or --base-files, and an unknown option are refused with exit 2, a message naming the value,
# and nothing written to $OUT.
source "$(dirname "$0")/preamble.sh"
AB="$ROOT/scripts/gpu/ab-bench"
export OUT="$TMP/out"

out=$("$AB" --help)
grep -q "^#   OUT=/tmp/out ./scripts/gpu/ab-bench \[--base REV\]" <<<"$out" || fail "help: $out"

refused() {  # EXPECTED-MESSAGE ARGS...
  local want="$1"; shift
  local err rc=0
  err=$("$AB" "$@" 2>&1 >/dev/null) || rc=$?
  [[ $rc == 2 ]] || fail "$* exited $rc, not 2: $err"
  grep -qF -- "$want" <<<"$err" || fail "$*: '$err' does not say '$want'"
  [[ ! -e "$OUT" ]] || fail "$* wrote $OUT"
}
refused "--runs takes a positive number, not '0'" --runs 0
refused "--runs takes a positive number, not 'two'" --runs two
refused "--base-files $TMP/none is not a folder" --base-files "$TMP/none"
refused "no commit no-such-revision here" --base no-such-revision
refused "unknown option --bogus" --bogus
mkdir -p "$TMP/v"
refused "--variant 'plain' is not NAME=DIR" --variant plain
refused "--variant 'base=$TMP/v' is not NAME=DIR" --variant "base=$TMP/v"
refused "--variant 'a b=$TMP/v' is not NAME=DIR" --variant "a b=$TMP/v"
refused "--variant v1: $TMP/none is not a folder" --variant "v1=$TMP/none"
refused "--variant v1 is given twice" --variant "v1=$TMP/v" --variant "v1=$TMP/v"
refused "--tests-variants runs the variants' tests: give one or more" --tests-variants
refused "--base-tree times variants against this tree: give one or more" --base-tree
refused "--base-tree makes this tree the base: not with --base or --base-files" --base-tree --base HEAD --variant "v1=$TMP/v"
refused "--base-tree makes this tree the base: not with --base or --base-files" --base-tree --base-files "$TMP/v" --variant "v1=$TMP/v"
printf 'not a diff\n' > "$TMP/bad.patch"
refused "--variant v2: tree-overlay: $TMP/bad.patch is not a patch" --variant "v2=$TMP/bad.patch"
cat > "$TMP/stale.patch" <<'PATCH'
diff --git a/README.md b/README.md
--- a/README.md
+++ b/README.md
@@ -1,1 +1,1 @@
-no such first line
+a new first line
PATCH
refused "--variant v3: tree-overlay: $TMP/stale.patch does not apply to this tree" --variant "v3=$TMP/stale.patch"
echo "ab-bench options: ok"
