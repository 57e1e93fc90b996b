#!/usr/bin/env bash
# Session 9, call 3 (nvidia-h200-x2). Builds (here): bash bench/stage_device.sh (main aef6b6d: the
# gather from 512 slot rows per rank with the capped copy, the GPU's BF16 tolerance, test_gpu's
# capped-copy case); TESTS=1 bash bench/build_variants.sh "g1=-DMM_GATHER=1" (one-process groups of
# several ranks gather too: the capped copy's in-place fallback runs); bash bench/build_variants.sh
# "s1@wip/stage-one="; bash bench/pack_devbin.sh.
# GPU 0: test_gpu main auto / ws / ws64 / stream, memcheck and racecheck auto. GPU 1: test_gpu g1 ws /
# auto, s1 (a one-block stage without fence and atomic) against main at T = 1, 8 on the three shapes,
# the streaming kernel's stall reasons at Mixtral and DSv3 T = 32 (2.1 vs 3.0 TB/s). Both: the 2-GPU
# pytest on main, EP2 DSv3 NVFP4 T_max 8192 at T = 1 ... 512, 8192 on main.
. bench/call_lib.sh
bin() { [ "$1" = main ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
(
  export CUDA_VISIBLE_DEVICES=0
  for g in auto ws ws64 stream; do
    MEGAMOE_GEMM=$g timeout 80 .devbin/test_gpu > "$L/test_gpu_main_$g.log" 2>&1
    echo "test_gpu main $g: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_main_$g.log" | tr '\n' ' ') at $(el) s"
  done
  for t in memcheck racecheck; do
    excl=(); [ $t = racecheck ] && excl=("${RACECHECK_EXCLUDE[@]}")
    left=$(( 330 - $(el) )); [ $left -gt 20 ] || { echo "$t: not run (time)"; continue; }
    MEGAMOE_GEMM=auto timeout $(( left < 70 ? left : 70 )) compute-sanitizer --tool $t --report-api-errors no \
      --error-exitcode 9 "${excl[@]}" .devbin/test_gpu --quick > "$L/sanitize_$t.log" 2>&1
    echo "$t auto: exit $? $(tail -n 1 "$L/sanitize_$t.log") at $(el) s"
  done
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for g in ws auto; do
    MEGAMOE_GEMM=$g timeout 80 .devbin/test_gpu_g1 > "$L/test_gpu_g1_$g.log" 2>&1
    echo "test_gpu g1 $g: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_g1_$g.log" | tr '\n' ' ') at $(el) s"
  done
  for s in "128 8 2048 768" "256 8 7168 2048" "8 2 4096 14336"; do
    set -- $s
    for n in s1 main; do
      timeout 40 "$(bin $n)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 1,8 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench1.log"
    done
  done
  for s in "8 2 4096 14336" "256 8 7168 2048"; do
    left=$(( 330 - $(el) )); [ $left -gt 30 ] || break
    OUT=$L timeout $(( left < 80 ? left : 80 )) bash bench/stalls.sh sm90_expert_stream_kernel "$s" 32 > /dev/null 2>&1
    echo "stalls stream $s T=32: exit $? at $(el) s"
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  MEGAMOE_CLI=.devbin/megamoe timeout 100 python3 -m pytest -q -p no:cacheprovider -rs tests/py/test_multi_gpu.py \
    > "$L/multi_gpu_main.txt" 2>&1
  echo "multi-GPU main: $(tail -n 1 "$L/multi_gpu_main.txt") at $(el) s"
  left=$(( 560 - $(el) ))
  [ $left -gt 25 ] && timeout $(( left < 90 ? left : 90 )) .devbin/megamoe bench --gpus 2 --format nvfp4 --experts 256 \
    --top-k 8 --hidden 7168 --inter 2048 --tokens 1,8,32,128,512,8192 --iters 10 2>&1 |
    sed "s/^bench:/bench[main dsv3 tmax 8192]:/" >> "$L/nccl.log"
  echo "both done at $(el) s"
) > "$L/both.txt" 2>&1
call_finish
