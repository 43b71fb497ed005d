#!/usr/bin/env bash
# scripts/gpu/tree-overlay, which ab-bench --variant builds with: apply lays a folder's files over the
# tree (replacing some, creating others in new folders) and restore gives back the tree byte for byte,
# created files removed, with the restored files newer than before (so that a build compiles them again).
# A second apply before a restore, a path through .git and a missing folder are refused. from-patch
# writes the files a patch changes or adds, as patched, into a new folder and leaves the tree as it was;
# a patch that deletes a file, one that does not apply and an existing folder are refused.
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

# from-patch, on patches git diff makes from two copies of the tree (named a and b: the prefixes git's own).
mkdir -p "$TMP/pa/a" "$TMP/pa/b"
cp -r kernels core "$TMP/pa/a/" && cp -r kernels core "$TMP/pa/b/"
printf 'kernel v1\nkernel v3\n' > "$TMP/pa/b/kernels/a.cu"
mkdir -p "$TMP/pa/b/docs" && printf 'added\n' > "$TMP/pa/b/docs/e.md"
(cd "$TMP/pa" && git diff --no-index --no-prefix a b > "$TMP/change.patch") && fail "git diff found no change"
"$OV" from-patch "$TMP/change.patch" "$TMP/fp"
[[ "$(cat "$TMP/fp/kernels/a.cu")" == $'kernel v1\nkernel v3' ]] || fail "from-patch: kernels/a.cu is $(cat "$TMP/fp/kernels/a.cu")"
[[ "$(cat "$TMP/fp/docs/e.md")" == "added" ]] || fail "from-patch did not add docs/e.md"
[[ "$(cd "$TMP/fp" && find . -type f | sort | tr '\n' ' ')" == "./docs/e.md ./kernels/a.cu " ]] ||
  fail "from-patch wrote files the patch does not change: $(cd "$TMP/fp" && find . -type f)"
after=$(find . -type f -exec md5sum {} + | sort)
[[ "$after" == "$before" ]] || fail "from-patch changed the tree"
err=$("$OV" from-patch "$TMP/change.patch" "$TMP/fp" 2>&1) && fail "from-patch into an existing folder was accepted"
grep -q "$TMP/fp exists" <<<"$err" || fail "existing folder: $err"

rm "$TMP/pa/b/core/b.cpp"
(cd "$TMP/pa" && git diff --no-index --no-prefix a b > "$TMP/delete.patch") || true
rc=0; err=$("$OV" from-patch "$TMP/delete.patch" "$TMP/fp2" 2>&1) || rc=$?
[[ $rc == 2 ]] && grep -q "deletes, renames or copies a file" <<<"$err" || fail "a deleting patch: exit $rc, $err"
[[ ! -e "$TMP/fp2" ]] || fail "a refused patch wrote $TMP/fp2"

printf 'kernel v0\n' > kernels/a.cu  # the patch's context no longer matches
rc=0; err=$("$OV" from-patch "$TMP/change.patch" "$TMP/fp3" 2>&1) || rc=$?
[[ $rc == 2 ]] && grep -q "does not apply to this tree" <<<"$err" || fail "a stale patch: exit $rc, $err"
[[ ! -e "$TMP/fp3" && "$(cat kernels/a.cu)" == "kernel v0" ]] || fail "a stale patch wrote something"
# record and refresh: after an overlay was built and taken back, a copy that gives the files their own older
# times leaves the build's objects looking newer. refresh touches (and names) each recorded path whose bytes
# differ from the overlay's, leaves alone one that holds the overlay's bytes, a file not recorded and a
# recorded path that is gone; a missing record is nothing to do. A record of a path leaving the tree is refused.
rt="$TMP/rt"
mkdir -p "$rt/kernels" "$TMP/ov2/kernels"
cd "$rt"
printf 'main\n' > kernels/x.cu; printf 'same\n' > kernels/y.cu; printf 'other\n' > kernels/z.cu
printf 'variant\n' > "$TMP/ov2/kernels/x.cu"; printf 'same\n' > "$TMP/ov2/kernels/y.cu"; printf 'gone\n' > "$TMP/ov2/kernels/w.cu"
"$OV" record "$TMP/ov2" build/overlaid.sha1
"$OV" record "$TMP/ov2" build/overlaid.sha1  # twice: one line a file
[[ $(wc -l < build/overlaid.sha1) == 3 ]] || fail "record: $(cat build/overlaid.sha1)"
grep -q "^$(sha1sum < "$TMP/ov2/kernels/x.cu" | cut -d' ' -f1)  kernels/x.cu\$" build/overlaid.sha1 ||
  fail "record: no line of the overlay's hash for kernels/x.cu: $(cat build/overlaid.sha1)"
touch -d '2020-01-01' kernels/x.cu kernels/y.cu kernels/z.cu
touched=$("$OV" refresh build/overlaid.sha1)
[[ "$touched" == "kernels/x.cu" ]] || fail "refresh touched '$touched', not kernels/x.cu alone"
[[ $(stat -c %Y kernels/x.cu) -gt $(date -d '2020-01-02' +%s) ]] || fail "refresh left kernels/x.cu at its old time"
for f in kernels/y.cu kernels/z.cu; do
  [[ $(stat -c %Y $f) -lt $(date -d '2020-01-02' +%s) ]] || fail "refresh touched $f"
done
[[ "$(cat kernels/x.cu)" == "main" && ! -e kernels/w.cu ]] || fail "refresh changed the tree's bytes"
[[ -z "$("$OV" refresh build/none.sha1)" ]] || fail "a missing record touched something"
mkdir -p "$TMP/ov5/.git" && printf 'x\n' > "$TMP/ov5/.git/config"
rc=0; err=$("$OV" record "$TMP/ov5" build/overlaid.sha1 2>&1) || rc=$?
[[ $rc == 2 ]] && grep -q "under .git" <<<"$err" || fail "a record of .git: exit $rc, $err"
[[ $(wc -l < build/overlaid.sha1) == 3 ]] || fail "a refused record wrote to the record"
echo "tree-overlay: ok"
