#!/usr/bin/env bash
# scripts/gpu/kernel-sass in a scratch repository, with stand-ins for nvcc (a "cubin" naming the source it
# compiled and its tree's kernels/ops.h, which it takes from the first include folder holding one, and which
# fails unless some include folder holds core/h.h, as the real kernels include core/) and cuobjdump (a listing of one kernel with as many LDG as ops.h
# says), so that the real sass_ops.py compares them: a patch that raises the count and a folder that keeps
# it, each built over a copy of this tree's kernels/ with its own files; files outside kernels/ named as
# left out; the tree untouched; a failing build exits 1; bad arguments exit 2.
source "$(dirname "$0")/preamble.sh"
repo="$TMP/repo" bin="$TMP/bin"
mkdir -p "$repo/scripts/gpu" "$repo/kernels" "$bin"
cp "$ROOT/scripts/gpu/kernel-sass" "$ROOT/scripts/gpu/tree-overlay" "$ROOT/scripts/gpu/sass_ops.py" "$ROOT/scripts/gpu/variants.sh" \
  "$ROOT/scripts/gpu/same_machine_code.py" "$repo/scripts/gpu/"
cat > "$repo/scripts/gpu-check" <<'STUB'
#!/usr/bin/env bash
exit 0
STUB
echo 1 > "$repo/kernels/ops.h"
printf '#include "kernels/ops.h"\n#include "core/h.h"\n' > "$repo/kernels/f.cu"
mkdir -p "$repo/core" && echo "// outside kernels/" > "$repo/core/h.h"
commit_scratch_repo "$repo"
cat > "$bin/nvcc" <<'STUB'
#!/usr/bin/env bash
out="" src="" inc="" core=""
while (($#)); do
  case "$1" in
    -o) out=$2; shift ;;
    -I*) d=${1#-I}
         [[ -z "$inc" && -f "$d/kernels/ops.h" ]] && inc=$d
         [[ -f "$d/core/h.h" ]] && core=$d ;;
    *.cu) src=$1 ;;
  esac
  shift
done
[[ -n "$core" ]] || { echo "stand-in nvcc: $src: core/h.h: No such file or directory"; exit 1; }
[[ "$(cat "$inc/kernels/ops.h")" != fail ]] || { echo "stand-in nvcc: error in $src"; exit 1; }
echo "$src $(cat "$inc/kernels/ops.h")" > "$out"
STUB
cat > "$bin/cuobjdump" <<'STUB'
#!/usr/bin/env bash
n=$(cut -d' ' -f2 < "$2")
printf '\tcode for sm_90a\n\t\tFunction : _Z6kernelv\n'
for ((i = 0; i < n; ++i)); do printf '        /*%04x*/                   LDG.E R0, desc[UR4][R2.64] ;\n' $((16 * i)); done
printf '        /*%04x*/                   EXIT ;\n' $((16 * n))
STUB
chmod +x "$bin/nvcc" "$bin/cuobjdump"
export PATH="$bin:$PATH" HH_NVCC_INCLUDES="-I/nonexistent/torch"
(cd "$repo" && echo 3 > kernels/ops.h && mkdir -p core && echo x > core/c.cpp && git add -A &&
  git diff --cached > "$TMP/more.patch" && git reset -q --hard)
mkdir -p "$TMP/same/kernels" && echo 1 > "$TMP/same/kernels/ops.h"
run() {  # NAME ARGS...: kernel-sass in the scratch repository; its exit status
  local name=$1; shift
  (cd "$repo" && OUT="$TMP/out-$name" ./scripts/gpu/kernel-sass "$@" > "$TMP/log-$name" 2>&1)
}
rc=0; run two kernels/f.cu "more=$TMP/more.patch" "same=$TMP/same" --kernel kernel || rc=$?
[[ $rc == 1 ]] || fail "a variant with more instructions: exit $rc: $(cat "$TMP/log-two")"
log="$TMP/log-two"
grep -q "^==> more against this tree (kernels/f.cu):" "$log" || fail "no heading for more: $(cat "$log")"
grep -qx "_Z6kernelv: 2 -> 4 instructions (+2)" "$TMP/out-two/more.txt" || fail "more: $(cat "$TMP/out-two/more.txt")"
grep -qE "^    LDG +1 -> 3 +\+2$" "$log" || fail "more's LDG: $(cat "$log")"
grep -qx "_Z6kernelv: the same counts, 2 instructions" "$TMP/out-two/same.txt" || fail "same: $(cat "$TMP/out-two/same.txt")"
grep -q "kernel-sass: more: not in the build (outside kernels/): core/c.cpp" "$log" || fail "core/c.cpp not named: $(cat "$log")"
[[ $(grep -c LDG "$TMP/out-two/this.sass") == 1 && $(grep -c LDG "$TMP/out-two/more.sass") == 3 ]] ||
  fail "the listings are not this tree's (1 LDG) and more's (3)"
[[ -z "$(cd "$repo" && git status --porcelain)" ]] || fail "the tree changed: $(cd "$repo" && git status --porcelain)"
rc=0; run same kernels/f.cu "same=$TMP/same" || rc=$?
[[ $rc == 0 ]] || fail "a variant with the same code: exit $rc: $(cat "$TMP/log-same")"
mkdir -p "$TMP/bad/kernels" && echo fail > "$TMP/bad/kernels/ops.h"
rc=0; run bad kernels/f.cu "bad=$TMP/bad" || rc=$?
[[ $rc == 1 ]] && grep -q "kernel-sass: bad: the build failed" "$TMP/log-bad" && grep -q "stand-in nvcc: error in" "$TMP/log-bad" ||
  fail "a failing build: exit $rc: $(cat "$TMP/log-bad")"
refused() {  # MESSAGE ARGS...
  local want=$1 r=0; shift
  run refused "$@" || r=$?
  ((r == 2)) && grep -qF "$want" "$TMP/log-refused" || fail "'$*': exit $r: $(cat "$TMP/log-refused")"
}
refused "give one or more variants" kernels/f.cu
refused "give a CUDA file of this tree's kernels/" "same=$TMP/same"
refused "kernel-sass: same is given twice" kernels/f.cu "same=$TMP/same" "same=$TMP/same"
refused "kernel-sass: 'this=$TMP/same' is not NAME=DIR or NAME=PATCH with NAME of letters, digits, - and _ (not this)" kernels/f.cu "this=$TMP/same"
refused "kernel-sass: x: $TMP/none is not a folder or a patch" kernels/f.cu "x=$TMP/none"
refused "no kernel matches 'nomatch'" kernels/f.cu "same=$TMP/same" --kernel nomatch
echo "kernel-sass: ok"
