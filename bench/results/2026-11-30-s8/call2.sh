#!/usr/bin/env bash
# Session 8 call 2 (nvidia-h200-x2): s8a = main after call 1's merges (combine cluster, ws ring
# position carried, tile_column helper, BF16 ws64 with a split planned). Built here:
#   bash bench/stage_device.sh
#   TESTS=1 bash bench/build_variants.sh "capall=-DWS_CAP_ALWAYS=1"
#   bash bench/build_variants.sh "capold@0044e43=-DWS_CAP_ALWAYS=1"; bash bench/pack_devbin.sh
# GPU 0: test_gpu s8a auto and with each kernel forced, capall with ws forced (the walking ws form on
# one GPU), memcheck and racecheck. GPU 1: the NVFP4 and BF16 tables (s8a), the walking ws form
# capall against capold (the ring position carried against divided). Both: the 2-GPU pytest, EP2.
set -u
OUT=${OUT:-device-out}
L=$OUT/logs
mkdir -p "$L"
tar xJf .devpack/devbin.tar.xz
. bench/device_env.sh
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
shapes=("256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336")
(
  export CUDA_VISIBLE_DEVICES=0
  for g in auto mma wgmma ws ws64 stream; do
    left=$(( 330 - $(el) )); [ $left -gt 20 ] || { echo "test_gpu $g: not run (time)"; continue; }
    MEGAMOE_GEMM=$g timeout $(( left < 90 ? left : 90 )) .devbin/test_gpu > "$L/test_gpu_$g.log" 2>&1
    echo "test_gpu s8a $g: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_$g.log" | tr '\n' ' ') at $(el) s"
  done
  MEGAMOE_GEMM=ws timeout 90 .devbin/test_gpu_capall > "$L/test_gpu_capall_ws.log" 2>&1
  echo "test_gpu capall ws: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_capall_ws.log" | tr '\n' ' ') at $(el) s"
  for run in "memcheck auto" "racecheck auto" "racecheck mma"; do
    set -- $run
    left=$(( 480 - $(el) )); [ $left -gt 15 ] || { echo "$run: not run (time)"; continue; }
    excl=(); [ "$1" = racecheck ] && excl=("${RACECHECK_EXCLUDE[@]}")
    MEGAMOE_GEMM=$2 timeout $left compute-sanitizer --tool "$1" --report-api-errors no --error-exitcode 9 "${excl[@]}" \
      .devbin/test_gpu --quick > "$L/sanitize_$1_$2.log" 2>&1
    echo "$run: exit $? $(tail -n 1 "$L/sanitize_$1_$2.log") at $(el) s"
  done
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for fmt in nvfp4 bf16; do
    tok=1,8,32,128,512,2048,8192; [ $fmt = bf16 ] && tok=8,32,128,512,2048,8192
    for s in "${shapes[@]}"; do
      set -- $s
      timeout 60 .devbin/megamoe bench --backend cuda --format $fmt --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens $tok --iters 10 2>&1 | sed "s/^bench:/bench[s8a]:/" >> "$L/bench1.log"
      [ $(el) -lt 330 ] || break 2
    done
  done
  for n in capall capold; do
    timeout 40 .devbin/megamoe_$n bench --backend cuda --format nvfp4 --experts 256 --top-k 8 --hidden 7168 --inter 2048 \
      --tokens 2048,8192 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench1.log"
  done
  echo "bench1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  left=$(( 540 - $(el) ))
  if [ $left -gt 40 ]; then
    MEGAMOE_CLI=.devbin/megamoe timeout $left python3 -m pytest -q -p no:cacheprovider -rs \
      tests/py/test_multi_gpu.py > "$L/multi_gpu.txt" 2>&1
    echo "multi-GPU s8a: $(tail -n 1 "$L/multi_gpu.txt") at $(el) s"
  else echo "multi-GPU: not run (time)"; fi
  left=$(( 585 - $(el) ))
  [ $left -gt 20 ] && timeout $left .devbin/megamoe bench --gpus 2 --format nvfp4 --experts 256 --top-k 8 --hidden 7168 --inter 2048 \
    --tokens 1,8,8192 --iters 10 2>&1 | sed "s/^bench:/bench[s8a nccl tmax 8192]:/" >> "$L/nccl.log"
) > "$L/both.txt" 2>&1
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs
cat "$L/gpu0.txt" "$L/gpu1.txt" "$L/both.txt"
cat "$L/bench1.log" "$L/nccl.log" | grep -E "median|per layer" | sed -E 's/R=1 backend=cuda: //; s/ over 10//; s/ of touched expert weights//; s/, [0-9.]+ GB\/s.*experts\)//; s/\(slowest rank.s median\)//; s/ TFLOP.s.*//' | cut -c1-110
