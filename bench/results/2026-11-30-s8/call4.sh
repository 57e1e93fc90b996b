#!/usr/bin/env bash
# Session 8 call 4 (nvidia-h200-x2, the last ~6 minutes). Builds (here):
#   bash bench/stage_device.sh   (wip/gather-one = t2: .devbin/megamoe, test_gpu)
#   bash bench/build_variants.sh "t@wip/ws-tma="; bash bench/pack_devbin.sh
# t2 = t (call 3) + the gathered copy per forward: across GPUs always, on one GPU when the ws kernels
# take gate/up (then their token tile by TMA). GPU 0: test_gpu t2 auto / ws / ws64, memcheck,
# racecheck. GPU 1: BF16 prefill t2 / t, NVFP4 decode t2 (no gather there). Both: the 2-GPU pytest
# on t2, EP2 DSv3 NVFP4 T_max 8192.
set -u
OUT=${OUT:-device-out}
L=$OUT/logs
mkdir -p "$L"
tar xJf .devpack/devbin.tar.xz
. bench/device_env.sh
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
bin() { [ "$1" = t2 ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
(
  export CUDA_VISIBLE_DEVICES=0
  for g in auto ws ws64; do
    MEGAMOE_GEMM=$g timeout 70 .devbin/test_gpu > "$L/test_gpu_t2_$g.log" 2>&1
    echo "test_gpu t2 $g: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_t2_$g.log" | tr '\n' ' ') at $(el) s"
  done
  for run in "memcheck auto" "racecheck auto"; do
    set -- $run
    excl=(); [ "$1" = racecheck ] && excl=("${RACECHECK_EXCLUDE[@]}")
    MEGAMOE_GEMM=$2 timeout 40 compute-sanitizer --tool "$1" --report-api-errors no --error-exitcode 9 "${excl[@]}" \
      .devbin/test_gpu --quick > "$L/sanitize_t2_$1.log" 2>&1
    echo "$run t2: exit $? $(tail -n 1 "$L/sanitize_t2_$1.log") at $(el) s"
  done
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for s in "8 2 4096 14336" "256 8 7168 2048"; do
    set -- $s
    for n in t2 t; do
      [ $(el) -lt 160 ] || continue
      timeout 40 "$(bin $n)" bench --backend cuda --format bf16 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 2048,8192 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench1.log"
    done
  done
  timeout 30 .devbin/megamoe bench --backend cuda --format nvfp4 --experts 256 --top-k 8 --hidden 7168 --inter 2048 \
    --tokens 1,8,512 --iters 10 2>&1 | sed "s/^bench:/bench[t2]:/" >> "$L/bench1.log"
  echo "bench1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  MEGAMOE_CLI=.devbin/megamoe timeout 70 python3 -m pytest -q -p no:cacheprovider -rs tests/py/test_multi_gpu.py \
    > "$L/multi_gpu.txt" 2>&1
  echo "multi-GPU t2: $(tail -n 1 "$L/multi_gpu.txt") at $(el) s"
  left=$(( 320 - $(el) ))
  [ $left -gt 25 ] && timeout $(( left < 60 ? left : 60 )) .devbin/megamoe bench --gpus 2 --format nvfp4 --experts 256 \
    --top-k 8 --hidden 7168 --inter 2048 --tokens 1,8,8192 --iters 10 2>&1 | sed "s/^bench:/bench[t2 dsv3 tmax 8192]:/" >> "$L/nccl.log"
  echo "both done at $(el) s"
) > "$L/both.txt" 2>&1
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs
cat "$L/gpu0.txt" "$L/gpu1.txt" "$L/both.txt"
cat "$L/bench1.log" "$L/nccl.log" 2>/dev/null | grep -E "median|per layer" | sed -E 's/R=1 backend=cuda: //; s/ over 10//; s/ of touched expert weights//; s/, [0-9.]+ GB\/s.*experts\)//; s/\(slowest rank.s median\)//; s/ TFLOP.s.*//; s/backend=nccl: //' | cut -c1-110
