# Sourced by scripts/gpu/ab-bench and scripts/gpu/kernel-sass: the NAME=DIR or NAME=PATCH variants they take,
# and what of a tree a build reads.
# NOT_BUILT: the paths no build reads, as an extended regular expression after a path's start: docs/, the
# Markdown files at the top, and scripts/gpu/candidates/ (whose patches come in as variants).
NOT_BUILT='docs/|scripts/gpu/candidates/|[^/]*\.md"?$'
# tree_fingerprint: 12 hex digits of the SHA-1 over the path and bytes of every file git lists here (tracked,
# and untracked unless ignored) that a build reads, so that figures name the exact tree they come from
# whatever its commit: run it in a copy of the same files to check that they are the ones timed.
tree_fingerprint() {
  git ls-files -co --exclude-standard -z | grep -zvE "^($NOT_BUILT)" | sort -zu |
    xargs -0 sha1sum -- 2> /dev/null | sha1sum | cut -c1-12
}
# add_variant WHO SPEC WORK [RESERVED ...]: appends NAME=FOLDER (absolute) to the caller's array VARIANTS.
# FOLDER is DIR, or for a patch WORK/NAME holding the files the patch changes, as they read with it applied
# (scripts/gpu/tree-overlay from-patch). NAME: letters, digits, - and _, none of RESERVED, not given before.
# Otherwise a message starting with WHO on standard error, and status 2.
add_variant() {
  local who=$1 spec=$2 work=$3 v
  shift 3
  local name="${spec%%=*}" dir="${spec#*=}" reserved="$*"
  if [[ "$spec" != *=* || ! "$name" =~ ^[A-Za-z0-9_-]+$ || " $reserved " == *" $name "* ]]; then
    echo "$who '$spec' is not NAME=DIR or NAME=PATCH with NAME of letters, digits, - and _${1:+ (not ${reserved// / or })}" >&2
    return 2
  fi
  for v in "${VARIANTS[@]}"; do
    [[ "${v%%=*}" != "$name" ]] || { echo "$who $name is given twice" >&2; return 2; }
  done
  if [[ -f "$dir" ]]; then
    mkdir -p "$work"
    scripts/gpu/tree-overlay from-patch "$dir" "$work/$name" 2>&1 | sed "s|^|$who $name: |" >&2
    ((PIPESTATUS[0] == 0)) || return 2
    dir="$work/$name"
  fi
  [[ -d "$dir" ]] || { echo "$who $name: $dir is not a folder or a patch" >&2; return 2; }
  VARIANTS+=("$name=$(cd "$dir" && pwd)")
}
