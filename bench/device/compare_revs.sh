#!/usr/bin/env bash
# Git revisions side by side on the GPU machine (how variants are compared: each variant is a commit
# or branch, not a compile-time switch).
#   here:  bash bench/device/compare_revs.sh build REV_A REV_B [REV_C ...]
#          builds `megamoe` of each revision (git archive into build-revs/, CUDA on) and stages them
#          packed as .devbin/rev-a/megamoe.xz, .devbin/rev-b/megamoe.xz, ... with the shared libraries
#          (this replaces .devbin; ~4 MB per revision; carry .devbin)
#          bash bench/device/compare_revs.sh stage-rev SIDE REV
#          the same for one revision as .devbin/rev-SIDE, keeping the rest of .devbin (how
#          bench/device/variant.sh stage adds its base and further revisions beside its test binaries)
#   there: bash bench/device/compare_revs.sh unpack
#          unpacks each staged .devbin/rev-*/megamoe.xz not unpacked yet (bench does it too)
#   there: bash bench/device/compare_revs.sh bench [TOKENS] [ROUNDS]
#          every staged build's `megamoe bench` (each .devbin/rev-*/megamoe, or its megamoe.xz unpacked)
#          on the three shapes, the builds in turn per shape, ROUNDS times (default 2); FORMATS
#          (default nvfp4), ACTIVATIONS (when the builds have --activations) and SHAPES_ONLY
#          ("E K H I;E K H I": those shapes instead of the three); prints per point the median ms of
#          each build (mean over rounds, spread) and each build's change against A
# To also test a revision there: check out it here, bench/device/stage.sh, bench/device/check.sh there.
set -euo pipefail
cd "$(dirname "$0")/../.."
# Builds revision $2's `megamoe` (git archive into build-revs/$1, CUDA on) packed as
# .devbin/rev-$1/megamoe.xz (unpacked there by `bench`), with its name in .devbin/rev-$1/REV.
stage_rev() {
  local side=$1 rev=$2 src=build-revs/$1/src
  rm -rf "build-revs/$side" && mkdir -p "$src"
  git archive "$rev" | tar -x -C "$src"
  cmake -S "$src" -B "build-revs/$side/build" -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_CUDA=ON \
    -DMEGAMOE_COMMIT="$(git rev-parse --short=12 "$rev")" >/dev/null
  cmake --build "build-revs/$side/build" -j "$(nproc)" --target megamoe_cli >/dev/null
  mkdir -p ".devbin/rev-$side"
  xz -T2 -1 -c "build-revs/$side/build/megamoe" > ".devbin/rev-$side/megamoe.xz"
  echo "$rev $(git rev-parse --short "$rev")" > ".devbin/rev-$side/REV"
}

# Each staged build's megamoe.xz into megamoe, where that is not there yet.
unpack_revs() {
  local d
  for d in .devbin/rev-?; do
    if [ ! -x "$d/megamoe" ] && [ -f "$d/megamoe.xz" ]; then xz -dc "$d/megamoe.xz" > "$d/megamoe" && chmod +x "$d/megamoe"; fi
  done
}

case ${1:-} in
unpack)
  unpack_revs
  ;;
stage-rev)
  [ $# -eq 3 ] || { echo "usage: $0 stage-rev SIDE REV" >&2; exit 2; }
  stage_rev "$2" "$3"
  ;;
build)
  [ $# -ge 3 ] || { echo "usage: $0 build REV_A REV_B [REV_C ...]" >&2; exit 2; }
  shift
  rm -rf .devbin && mkdir -p .devbin/libs
  sides=(a b c d e f g h)
  [ $# -le ${#sides[@]} ] || { echo "compare_revs: at most ${#sides[@]} revisions" >&2; exit 2; }
  i=0
  for rev in "$@"; do
    stage_rev "${sides[$i]}" "$rev"
    i=$((i + 1))
  done
  for lib in libjansson.so.4 libgomp.so.1; do cp -L "/lib/x86_64-linux-gnu/$lib" .devbin/libs/; done
  cp -L "$(ldd build-revs/a/build/megamoe | awk '/libcudart/ {print $3}')" .devbin/libs/
  du -sh .devbin
  ;;
bench)
  . bench/device/env.sh
  OUT=${OUT:-device-out}
  mkdir -p "$OUT"
  log=$OUT/compare_revs.log
  : > "$log"
  tokens=${2:-1,8,32,128,512,2048,8192}
  rounds=${3:-2} # read before the shape loop's `set --` replaces the positional parameters
  unpack_revs
  sides=()
  for d in .devbin/rev-?; do
    [ -x "$d/megamoe" ] && sides+=("${d#.devbin/rev-}")
  done
  [ "${sides[0]:-}" = a ] && [ ${#sides[@]} -ge 2 ] || { echo "compare_revs: no .devbin/rev-a and rev-b builds" >&2; exit 2; }
  acts=(default)
  SHAPES=("${SHAPES3[@]}")
  [ -n "${SHAPES_ONLY:-}" ] && IFS=";" read -ra SHAPES <<< "$SHAPES_ONLY"
  .devbin/rev-a/megamoe bench --help | grep -q -- '--activations' && acts=(${ACTIVATIONS:-bf16})
  for fmt in ${FORMATS:-nvfp4}; do
    for s in "${SHAPES[@]}"; do
      set -- $s
      for a in "${acts[@]}"; do
        aa=(); [ "$a" != default ] && [ "$fmt" = nvfp4 ] && aa=(--activations "$a")
        for ((r = 0; r < rounds; r++)); do
          for side in "${sides[@]}"; do
            timeout 300 ".devbin/rev-$side/megamoe" bench --backend cuda --format "$fmt" "${aa[@]}" --experts $1 --top-k $2 \
              --hidden $3 --inter $4 --tokens "$tokens" --iters 10 2>&1 | sed "s/^bench:/bench[$side]:/" >> "$log"
          done
        done
      done
    done
  done
  for side in "${sides[@]}"; do echo "${side^^} = $(cat .devbin/rev-$side/REV)"; done
  python3 - "$log" "${sides[@]}" <<'PY'
import re, statistics, sys
sides = sys.argv[2:]
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"bench\[(\w)\]: (E=\d+ K=\d+ H=\d+ I=\d+) T=(\d+) (\w+)([^:]*):.*median ([\d.]+) ms", line)
    if m:
        side, shape, T, fmt, rest, ms = m.groups()
        rows.setdefault((shape, fmt + rest.split(" R=")[0], int(T)), {}).setdefault(side, []).append(float(ms))
mean = lambda x: statistics.mean(x) if x else float("nan")
sp = lambda x: f"{(max(x) - min(x)) / statistics.mean(x) * 100:.1f}%" if len(x) > 1 else "-"
head = f"{'shape':26s} {'format':18s} {'T':>5s} " + " ".join(f"{s.upper() + ' ms':>9s}" for s in sides)
head += " " + " ".join(f"{s.upper() + ' vs A':>8s}" for s in sides[1:]) + "  spread " + " / ".join(s.upper() for s in sides)
print(head)
for (shape, fmt, T), v in sorted(rows.items()):
    ms = [mean(v.get(s, [])) for s in sides]
    line = f"{shape:26s} {fmt:18s} {T:5d} " + " ".join(f"{m:9.4f}" for m in ms)
    line += " " + " ".join(f"{(m / ms[0] - 1) * 100:+7.1f}%" for m in ms[1:])
    print(line + "  " + " / ".join(sp(v.get(s, [])) for s in sides))
PY
  ;;
*)
  echo "usage: $0 build REV_A REV_B [REV_C ...] | stage-rev SIDE REV (here) | unpack | bench [TOKENS] [ROUNDS] (there)" >&2
  exit 2
  ;;
esac
