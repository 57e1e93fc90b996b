#!/usr/bin/env bash
# Prepared in session 7 for the first call of session 8 (nvidia-h200-x2; not yet run). Builds, here:
#   bash bench/stage_device.sh
#   TESTS=1 bash bench/build_variants.sh "mloop@wip/mma-loop=" "bsplit=-DMM_WS64_BF16_SPLIT=1" \
#     "ccl@wip/combine-cluster=" "incrall@wip/ws-incr=-DWS_CAP_ALWAYS=1" "pk@wip/phase-k="
#   bash bench/pack_devbin.sh
# then, device tool with carry .devpack: bash bench/results/<date>/call1.sh (this file, copied under
# the new session's bench/results/<date>/ first). Every step is time-limited; logs in $OUT/logs.tar.gz.
# GPU 0: test_gpu main (auto: the routing refactor 254b21d, not yet run), ccl, pk, mloop, bsplit (auto). GPU 1: NVFP4 decode main / ccl,
# Qwen3 and DSv3 mid/prefill main / pk, BF16 few-token main / bsplit, prefill main / incrall. Both:
# BF16 EP2 with T_max 8 / 8192, main / mloop; the 2-GPU pytest on ccl, then mloop.
set -u
OUT=${OUT:-device-out}
L=$OUT/logs
mkdir -p "$L"
tar xJf .devpack/devbin.tar.xz
. bench/device_env.sh
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
bin() { [ "$1" = main ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
b() { # build fmt tokens E K H I
  local n=$1 fmt=$2 tok=$3; shift 3
  timeout 90 "$(bin "$n")" bench --backend cuda --format "$fmt" --experts $1 --top-k $2 --hidden $3 --inter $4 \
    --tokens "$tok" --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/"
}
DS="256 8 7168 2048" QW="128 8 2048 768" MX="8 2 4096 14336"
(
  export CUDA_VISIBLE_DEVICES=0
  for t in main ccl pk mloop bsplit; do
    left=$(( 380 - $(el) )); [ $left -gt 20 ] || { echo "test_gpu $t: not run (time)"; continue; }
    tb=.devbin/test_gpu_$t; [ $t = main ] && tb=.devbin/test_gpu
    MEGAMOE_GEMM=auto timeout $(( left < 90 ? left : 90 )) $tb > "$L/test_gpu_${t}_auto.log" 2>&1
    echo "test_gpu $t auto: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_${t}_auto.log" | tr '\n' ' ') at $(el) s"
  done
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for s in "$DS" "$QW" "$MX"; do for n in main ccl; do b $n nvfp4 1,8,32 $s; done; done >> "$L/bench1.log"
  for n in main pk; do b $n nvfp4 256,512,1024 $DS; b $n nvfp4 512,2048,8192 $QW; done >> "$L/bench1.log"
  for s in "$DS" "$QW" "$MX"; do for n in main bsplit; do b $n bf16 8,32,128,256 $s; done; done >> "$L/bench1.log"
  for s in "$DS" "$MX"; do for n in main incrall; do b $n nvfp4 2048,8192 $s; done; done >> "$L/bench1.log"
  echo "bench1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  for n in main mloop; do
    for tok in 1,8 1,8,8192; do
      timeout 45 "$(bin $n)" bench --gpus 2 --format bf16 --experts 256 --top-k 8 --hidden 7168 --inter 2048 \
        --tokens $tok --iters 10 2>&1 | sed "s/^bench:/bench[$n bf16 nccl tmax ${tok##*,}]:/" >> "$L/nccl.log"
      [ $(el) -lt 470 ] || break 2
    done
  done
  for n in ccl mloop; do
    left=$(( 585 - $(el) )); [ $left -gt 40 ] || { echo "multi-GPU $n: not run (time)"; continue; }
    MEGAMOE_CLI=$(bin $n) timeout $left python3 -m pytest -q -p no:cacheprovider -rs tests/py/test_multi_gpu.py \
      > "$L/multi_gpu_$n.txt" 2>&1
    echo "multi-GPU $n: $(tail -n 1 "$L/multi_gpu_$n.txt") at $(el) s"
  done
) > "$L/both.txt" 2>&1
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs
cat "$L/gpu0.txt" "$L/gpu1.txt" "$L/both.txt"
cat "$L/bench1.log" "$L/nccl.log" | grep -E "median|per layer" | sed -E 's/R=1 backend=cuda: //; s/ over 10//; s/ of touched expert weights//; s/, [0-9.]+ GB\/s.*experts\)//; s/\(slowest rank.s median\)//' | cut -c1-120
