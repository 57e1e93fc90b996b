#!/usr/bin/env bash
# sass_diff.sh -- compare the SASS of every kernel of two builds of the library, function by function.
#   dev/sass_diff.sh OLD_LIB NEW_LIB [RENAMES | auto]
# OLD_LIB / NEW_LIB: libmegamoe.a (or any file cuobjdump reads) of the two builds, e.g. a build of the
# base revision in a second worktree and the current build. RENAMES (optional): a file of lines
# "old_mangled_name new_mangled_name" for kernels renamed between the two; or `auto`: kernels whose
# demangled name and template arguments agree are paired whatever their parameter lists, after the
# sed expression SASS_DIFF_RENAME (if set) is applied to the old names, e.g.
#   SASS_DIFF_RENAME='s/sm90_expert_gemm_kernel/sm90_expert_mma_kernel/' dev/sass_diff.sh old.a new.a auto
# Addresses, line info and the /*offset*/ columns are stripped; each function's instructions are
# compared as text. Prints one line per function that differs or exists on one side only, then a
# summary; exits 0 when every function of the old build is identical in the new one.
# SASS_DIFF_PARAMS=ignore: constant bank 0 offsets (c[0x0][...], the kernel parameters) compare equal,
# for a change that only moves a field of a struct passed by value (e.g. mm_buffer_layout).
set -euo pipefail
old=$1 new=$2 renames=${3:-}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

split_functions() { # $1 = library, $2 = output folder: one file per function
    mkdir -p "$2"
    cuobjdump -sass "$1" | awk -v dir="$2" -v params="${SASS_DIFF_PARAMS:-}" '
        /^[[:space:]]*Function : / { name = $3; file = dir "/" name; next }
        /^[[:space:]]*\.+$/ || /^[[:space:]]*$/ { next }
        name != "" && /\/\*[0-9a-f][0-9a-f][0-9a-f][0-9a-f]+\*\// {
            line = $0
            sub(/^[[:space:]]*\/\*[0-9a-f]+\*\/[[:space:]]*/, "", line) # the offset column
            sub(/[[:space:]]*\/\* 0x[0-9a-f]+ \*\/[[:space:]]*$/, "", line) # the encoding
            if (params == "ignore") gsub(/c\[0x0\]\[0x[0-9a-f]+\]/, "c[0x0][P]", line)
            print line >> file
            next
        }
        name != "" && /\/\* 0x[0-9a-f]+ \*\// { next } # the second encoding word
    '
}
split_functions "$old" "$work/old"
split_functions "$new" "$work/new"
if [ "$renames" = auto ]; then # pair by demangled name and template arguments
    key() { c++filt | sed -e 's/(.*$//' -e 's/^void //'; }
    (cd "$work/new" && ls) > "$work/new.names"
    (cd "$work/old" && ls) > "$work/old.names"
    tab=$(printf '\t')
    paste "$work/new.names" <(key < "$work/new.names") | sort -t "$tab" -k2,2 > "$work/new.keys"
    paste "$work/old.names" <(key < "$work/old.names" | sed -e "${SASS_DIFF_RENAME:-}") | sort -t "$tab" -k2,2 \
        > "$work/old.keys"
    join -t "$tab" -1 2 -2 2 "$work/old.keys" "$work/new.keys" | awk -F "$tab" '$2 != $3 { print $2, $3 }' \
        > "$work/renames"
    echo "auto: $(wc -l < "$work/renames") kernels paired by name and template arguments"
    renames=$work/renames
fi
if [ -n "$renames" ]; then
    while read -r o n; do
        [ -z "$o" ] && continue
        [ -f "$work/old/$o" ] && mv "$work/old/$o" "$work/old/$n"
    done < "$renames"
fi
same=0 differ=0 gone=0 added=0
for f in "$work"/old/*; do
    n=$(basename "$f")
    if [ ! -f "$work/new/$n" ]; then echo "only in old: $n"; gone=$((gone + 1)); continue; fi
    if cmp -s "$f" "$work/new/$n"; then same=$((same + 1)); else
        echo "differs: $n ($(diff "$f" "$work/new/$n" | grep -c '^[<>]') lines)"; differ=$((differ + 1)); fi
done
for f in "$work"/new/*; do
    n=$(basename "$f")
    [ -f "$work/old/$n" ] || { echo "only in new: $n"; added=$((added + 1)); }
done
echo "functions: $((same + differ + gone)) old, $((same + differ + added)) new; identical $same, differ $differ, only old $gone, only new $added"
[ "$differ" -eq 0 ] && [ "$gone" -eq 0 ]
