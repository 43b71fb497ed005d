#!/usr/bin/env bash
# scripts/gpu/tree-overlay, which ab-bench --variant builds with: apply lays a folder's files over the
# tree (replacing some, creating others in new folders) and restore gives back the tree byte for byte,
# created files removed, with the restored files newer than before (so that a build compiles them again).
# A second apply before a restore, a path through .git and a missing folder are refused.
source "$(dirname "$0")/preamble.sh"
OV="$ROOT/scripts/gpu/tree-overlay"
tree="$TMP/tree" over="$TMP/over" saved="$TMP/saved"
mkdir -p "$tree/kernels" "$tree/core" "$over/kernels" "$over/docs/new"
printf 'kernel v1\n' > "$tree/kernels/a.cu"
printf 'core\n' > "$tree/core/b.cpp"
printf 'kept\n' > "$tree/kernels/c.cu"
touch -d '2020-01-01' "$tree/kernels/a.cu"
printf 'kernel v2\n' > "$over/kernels/a.cu"
printf 'a new file\n' > "$over/docs/new/d.md"
before=$(cd "$tree" && find . -type f -exec md5sum {} + | sort)

cd "$tree"
"$OV" apply "$over" "$saved"
[[ "$(cat kernels/a.cu)" == "kernel v2" ]] || fail "apply did not replace kernels/a.cu"
[[ "$(cat docs/new/d.md)" == "a new file" ]] || fail "apply did not create docs/new/d.md"
[[ "$(cat kernels/c.cu)" == "kept" && "$(cat core/b.cpp)" == "core" ]] || fail "apply touched files not in the overlay"
err=$("$OV" apply "$over" "$saved" 2>&1) && fail "a second apply was accepted"
grep -q "exists (an overlay not restored?)" <<<"$err" || fail "second apply: $err"

"$OV" restore "$saved"
after=$(find . -type f -exec md5sum {} + | sort)
[[ "$after" == "$before" ]] || fail "restore did not give the tree back: $after"
[[ ! -e "$saved" ]] || fail "restore left $saved"
[[ $(stat -c %Y kernels/a.cu) -gt $(date -d '2020-01-02' +%s) ]] || fail "the restored file kept its old time"

mkdir -p "$TMP/bad/.git"
printf 'x\n' > "$TMP/bad/.git/config"
err=$("$OV" apply "$TMP/bad" "$saved" 2>&1) && fail "an overlay of .git was accepted"
grep -q "is under .git" <<<"$err" || fail ".git overlay: $err"
[[ ! -e "$saved" && ! -e .git ]] || fail "a refused overlay wrote something"
rc=0; "$OV" apply "$TMP/none" "$saved" 2>/dev/null || rc=$?
[[ $rc == 2 ]] || fail "a missing folder exited $rc, not 2"
echo "tree-overlay: ok"
