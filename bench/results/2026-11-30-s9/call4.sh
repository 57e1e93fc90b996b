#!/usr/bin/env bash
# Session 9, call 4 (nvidia-h200-x2): main 33c47ff as it lands (the gather from 512 slot rows with
# the capped copy, the one-block stage without fence and atomic, the GPU's BF16 tolerance, test_gpu's
# capped-copy case with its NCCL run fixed). Builds (here): bash bench/stage_device.sh;
# TESTS=1 bash bench/build_variants.sh "g1=-DMM_GATHER=1"; bash bench/pack_devbin.sh.
# GPU 0: test_gpu auto / ws / ws64, memcheck and racecheck auto. GPU 1: test_gpu g1 ws / auto, then
# the NVFP4 table (three shapes, T = 1 ... 8192) of the landed code. Both: the 2-GPU pytest.
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  for g in auto ws ws64; do
    MEGAMOE_GEMM=$g timeout 80 .devbin/test_gpu > "$L/test_gpu_main_$g.log" 2>&1
    echo "test_gpu main $g: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_main_$g.log" | tr '\n' ' ') at $(el) s"
  done
  for t in memcheck racecheck; do
    excl=(); [ $t = racecheck ] && excl=("${RACECHECK_EXCLUDE[@]}")
    MEGAMOE_GEMM=auto timeout 70 compute-sanitizer --tool $t --report-api-errors no \
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
  for s in "128 8 2048 768" "8 2 4096 14336" "256 8 7168 2048"; do
    set -- $s
    left=$(( 300 - $(el) )); [ $left -gt 20 ] || break
    timeout $(( left < 60 ? left : 60 )) .devbin/megamoe bench --backend cuda --format nvfp4 --experts $1 --top-k $2 \
      --hidden $3 --inter $4 --tokens 1,8,32,128,512,2048,8192 --iters 10 2>&1 | sed "s/^bench:/bench[main]:/" >> "$L/bench1.log"
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  left=$(( 540 - $(el) ))
  MEGAMOE_CLI=.devbin/megamoe timeout $(( left < 100 ? left : 100 )) python3 -m pytest -q -p no:cacheprovider -rs \
    tests/py/test_multi_gpu.py > "$L/multi_gpu_main.txt" 2>&1
  echo "multi-GPU main: $(tail -n 1 "$L/multi_gpu_main.txt") at $(el) s"
) > "$L/both.txt" 2>&1
call_finish
