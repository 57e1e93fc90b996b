#!/usr/bin/env bash
# Session 8 call 3 (nvidia-h200-x2), short (~5 min) so a second call can follow up. Builds (here):
#   bash bench/stage_device.sh                      (wip/ws-tma = t: .devbin/megamoe, test_gpu)
#   TESTS=1 bash bench/build_variants.sh "gall=-DMM_GATHER=1"   (t, gathering on one GPU too)
#   bash bench/build_variants.sh "main@main=" "g@f26beb8="; bash bench/pack_devbin.sh
# t = main + the gather under NCCL (wip/gather) + the ws kernel's token tile by 2D TMA where rows are
# slot-ordered (down projection always; gate/up when gathered). GPU 0: test_gpu t auto / ws / ws64,
# gall auto / ws, memcheck t. GPU 1: prefill t / gall / main. Both: the 2-GPU pytest on t, EP2 DSv3
# T_max 8192 t (main: call 2).
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
  MEGAMOE_GEMM=auto timeout 40 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    .devbin/test_gpu --quick > "$L/sanitize_t_memcheck.log" 2>&1
  echo "memcheck auto t: exit $? $(tail -n 1 "$L/sanitize_t_memcheck.log") at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for fmt in nvfp4 bf16; do
    for s in "256 8 7168 2048" "8 2 4096 14336"; do
      set -- $s
      for n in t gall main; do
        [ $(el) -lt 200 ] || continue
        timeout 40 "$(bin $n)" bench --backend cuda --format $fmt --experts $1 --top-k $2 --hidden $3 --inter $4 \
          --tokens 2048,8192 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench1.log"
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
  left=$(( 330 - $(el) ))
  [ $left -gt 25 ] && timeout $(( left < 60 ? left : 60 )) .devbin/megamoe bench --gpus 2 --format nvfp4 --experts 256 \
    --top-k 8 --hidden 7168 --inter 2048 --tokens 1,8,8192 --iters 10 2>&1 | sed "s/^bench:/bench[t dsv3 tmax 8192]:/" >> "$L/nccl.log"
  echo "both done at $(el) s"
) > "$L/both.txt" 2>&1
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs
cat "$L/gpu0.txt" "$L/gpu1.txt" "$L/both.txt"
cat "$L/bench1.log" "$L/nccl.log" | grep -E "median|per layer" | sed -E 's/R=1 backend=cuda: //; s/ over 10//; s/ of touched expert weights//; s/, [0-9.]+ GB\/s.*experts\)//; s/\(slowest rank.s median\)//; s/ TFLOP.s.*//; s/backend=nccl: //' | cut -c1-110
