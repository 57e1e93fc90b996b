#!/usr/bin/env bash
# Two git revisions side by side on the GPU machine (how variants are compared: each variant is a
# commit or branch, not a compile-time switch).
#   here:  bash bench/device/compare_revs.sh build REV_A REV_B
#          builds `megamoe` of each revision (git archive into build-revs/, CUDA on) and stages them
#          as .devbin/rev-a/megamoe and .devbin/rev-b/megamoe with the shared libraries (this replaces
#          .devbin; ~35 MB, carry .devbin)
#   there: bash bench/device/compare_revs.sh bench [TOKENS] [ROUNDS]
#          both builds' `megamoe bench` on the three shapes, alternating A, B per shape, ROUNDS times
#          (default 2); FORMATS (default nvfp4), ACTIVATIONS (when the builds have --activations) and
#          SHAPES_ONLY ("E K H I;E K H I": those shapes instead of the three);
#          prints per point the median ms of each build (mean over rounds, spread) and B's change
# To also test a revision there: check out it here, bench/device/stage.sh, bench/device/check.sh there.
set -euo pipefail
cd "$(dirname "$0")/../.."
case ${1:-} in
build)
  [ $# -eq 3 ] || { echo "usage: $0 build REV_A REV_B" >&2; exit 2; }
  rm -rf .devbin && mkdir -p .devbin/libs
  for side in a b; do
    rev=$([ $side = a ] && echo "$2" || echo "$3")
    src=build-revs/$side/src
    rm -rf "build-revs/$side" && mkdir -p "$src"
    git archive "$rev" | tar -x -C "$src"
    cmake -S "$src" -B "build-revs/$side/build" -DCMAKE_BUILD_TYPE=Release -DMEGAMOE_CUDA=ON >/dev/null
    cmake --build "build-revs/$side/build" -j "$(nproc)" --target megamoe_cli >/dev/null
    mkdir -p ".devbin/rev-$side"
    cp "build-revs/$side/build/megamoe" ".devbin/rev-$side/"
    echo "$rev $(git rev-parse --short "$rev")" > ".devbin/rev-$side/REV"
  done
  for lib in libjansson.so.4 libgomp.so.1; do cp -L "/lib/x86_64-linux-gnu/$lib" .devbin/libs/; done
  cp -L "$(ldd .devbin/rev-a/megamoe | awk '/libcudart/ {print $3}')" .devbin/libs/
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
          for side in a b; do
            timeout 300 ".devbin/rev-$side/megamoe" bench --backend cuda --format "$fmt" "${aa[@]}" --experts $1 --top-k $2 \
              --hidden $3 --inter $4 --tokens "$tokens" --iters 10 2>&1 | sed "s/^bench:/bench[$side]:/" >> "$log"
          done
        done
      done
    done
  done
  echo "A = $(cat .devbin/rev-a/REV), B = $(cat .devbin/rev-b/REV)"
  python3 - "$log" <<'PY'
import re, statistics, sys
rows = {}
for line in open(sys.argv[1]):
    m = re.match(r"bench\[(a|b)\]: (E=\d+ K=\d+ H=\d+ I=\d+) T=(\d+) (\w+)([^:]*):.*median ([\d.]+) ms", line)
    if m:
        side, shape, T, fmt, rest, ms = m.groups()
        rows.setdefault((shape, fmt + rest.split(" R=")[0], int(T)), {}).setdefault(side, []).append(float(ms))
print(f"{'shape':26s} {'format':18s} {'T':>5s} {'A ms':>9s} {'B ms':>9s} {'B vs A':>8s}  spread A / B")
for (shape, fmt, T), v in sorted(rows.items()):
    a, b = v.get("a", []), v.get("b", [])
    ma, mb = (statistics.mean(a) if a else float("nan")), (statistics.mean(b) if b else float("nan"))
    sp = lambda x: f"{(max(x) - min(x)) / statistics.mean(x) * 100:.1f}%" if len(x) > 1 else "-"
    print(f"{shape:26s} {fmt:18s} {T:5d} {ma:9.4f} {mb:9.4f} {(mb / ma - 1) * 100:+7.1f}%  {sp(a)} / {sp(b)}")
PY
  ;;
*)
  echo "usage: $0 build REV_A REV_B (here) | bench [TOKENS] [ROUNDS] (on the GPU machine)" >&2
  exit 2
  ;;
esac
