#!/usr/bin/env bash
# Session 8 call 3 (nvidia-h200-x2). Builds (here):
#   bash bench/stage_device.sh                      (wip/ws-tma = t: .devbin/megamoe, test_gpu)
#   TESTS=1 bash bench/build_variants.sh "gall=-DMM_GATHER=1"   (t, gathering on one GPU too)
#   bash bench/build_variants.sh "main@main=" "g@f26beb8="; bash bench/pack_devbin.sh
# t = main + the gather under NCCL (wip/gather) + the ws kernel's token tile by 2D TMA where rows are
# slot-ordered (down projection always; gate/up when gathered). GPU 0: test_gpu t auto / ws / ws64,
# gall auto / ws, memcheck + racecheck t, ncu of Qwen3 T = 1, 8. GPU 1: prefill t / gall / main.
# Both: the 2-GPU pytest on t, EP2 DSv3 T_max 8 and 8192 t / g / main, EP2 Mixtral T_max 4096 t.
set -u
OUT=${OUT:-device-out}
L=$OUT/logs
mkdir -p "$L"
tar xJf .devpack/devbin.tar.xz
. bench/device_env.sh
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
bin() { [ "$1" = t ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
tg() { # test_gpu build gemm
  local b=.devbin/test_gpu; [ "$1" = t ] || b=.devbin/test_gpu_$1
  MEGAMOE_GEMM=$2 timeout 90 $b > "$L/test_gpu_$1_$2.log" 2>&1
  echo "test_gpu $1 $2: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_$1_$2.log" | tr '\n' ' ') at $(el) s"
}
(
  export CUDA_VISIBLE_DEVICES=0
  tg t auto; tg t ws; tg t ws64; tg gall auto; tg gall ws
  for run in "memcheck auto" "racecheck auto"; do
    set -- $run
    excl=(); [ "$1" = racecheck ] && excl=("${RACECHECK_EXCLUDE[@]}")
    MEGAMOE_GEMM=$2 timeout 60 compute-sanitizer --tool "$1" --report-api-errors no --error-exitcode 9 "${excl[@]}" \
      .devbin/test_gpu --quick > "$L/sanitize_t_$1.log" 2>&1
    echo "$run t: exit $? $(tail -n 1 "$L/sanitize_t_$1.log") at $(el) s"
  done
  [ $(el) -lt 280 ] && OUT=$L timeout 50 bash bench/profile.sh nvfp4 "128 8 2048 768" 1,8 > "$L/profile_qwen3.txt" 2>&1
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for fmt in nvfp4 bf16; do
    for s in "256 8 7168 2048" "8 2 4096 14336" "128 8 2048 768"; do
      set -- $s
      for n in t gall main; do
        [ $(el) -lt 320 ] || continue
        timeout 40 "$(bin $n)" bench --backend cuda --format $fmt --experts $1 --top-k $2 --hidden $3 --inter $4 \
          --tokens 512,2048,8192 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench1.log"
      done
    done
  done
  echo "bench1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  MEGAMOE_CLI=.devbin/megamoe timeout 80 python3 -m pytest -q -p no:cacheprovider -rs tests/py/test_multi_gpu.py \
    > "$L/multi_gpu.txt" 2>&1
  echo "multi-GPU t: $(tail -n 1 "$L/multi_gpu.txt") at $(el) s"
  for n in t g main; do
    left=$(( 560 - $(el) )); [ $left -gt 25 ] || break
    timeout $(( left < 60 ? left : 60 )) "$(bin $n)" bench --gpus 2 --format nvfp4 --experts 256 --top-k 8 --hidden 7168 \
      --inter 2048 --tokens 1,8,8192 --iters 10 2>&1 | sed "s/^bench:/bench[$n dsv3 tmax 8192]:/" >> "$L/nccl.log"
  done
  left=$(( 580 - $(el) ))
  [ $left -gt 20 ] && timeout $left .devbin/megamoe bench --gpus 2 --format nvfp4 --experts 8 --top-k 2 --hidden 4096 \
    --inter 14336 --tokens 1,8,128,4096 --iters 10 2>&1 | sed "s/^bench:/bench[t mixtral tmax 4096]:/" >> "$L/nccl.log"
  echo "both done at $(el) s"
) > "$L/both.txt" 2>&1
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs
cat "$L/gpu0.txt" "$L/gpu1.txt" "$L/both.txt"
grep -v "^==" "$L/profile_qwen3.txt" 2>/dev/null | cut -c1-130
cat "$L/bench1.log" "$L/nccl.log" | grep -E "median|per layer" | sed -E 's/R=1 backend=cuda: //; s/ over 10//; s/ of touched expert weights//; s/, [0-9.]+ GB\/s.*experts\)//; s/\(slowest rank.s median\)//; s/ TFLOP.s.*//; s/backend=nccl: //' | cut -c1-110
