#!/usr/bin/env bash
# Session 10 call 4 (nvidia-h200-x2): wip/fence-acqrel (= main + the narrow wgmma + the two-layout
# streaming kernel + one-thread acq_rel fences at the split-K / stage hand-offs), the candidate for
# main. Builds (here): bash bench/stage_device.sh; bash bench/build_variants.sh "old@main="
# "xg2@wip/stream-xg2=" "trace=-DMM_STREAM_TRACE=1"; bash bench/pack_devbin.sh.
# GPU 0: test_gpu auto / mma / wgmma, memcheck auto / stream / wgmma, racecheck auto / mma / wgmma.
# GPU 1: old / xg2 / new at T = 1, 8, 32 (three shapes, twice alternating), the trace at Qwen3 T = 1
#        and 8, test_gpu stream / ws / ws64, memcheck ws, then the NVFP4 and BF16 tables.
# Both: the 2-GPU pytest.
. bench/call_lib.sh
bin() { [ "$1" = new ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
tg() { # mode: test_gpu with that GEMM kernel forced
  MEGAMOE_GEMM=$1 timeout 100 .devbin/test_gpu > "$L/test_gpu_$1.log" 2>&1
  echo "test_gpu $1: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_$1.log" | tr '\n' ' ') at $(el) s"
}
san() { # tool mode
  local excl=(); [ $1 = racecheck ] && excl=("${RACECHECK_EXCLUDE[@]}")
  MEGAMOE_GEMM=$2 timeout 120 compute-sanitizer --tool $1 --report-api-errors no --error-exitcode 9 "${excl[@]}" \
    .devbin/test_gpu --quick > "$L/$1_$2.log" 2>&1
  echo "$1 $2: exit $? $(tail -n 1 "$L/$1_$2.log") at $(el) s"
}
(
  export CUDA_VISIBLE_DEVICES=0
  for g in auto mma wgmma; do tg $g; done
  for g in auto stream wgmma; do san memcheck $g; done
  for g in auto mma wgmma; do san racecheck $g; done
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for n in old xg2 new old xg2 new; do
    for s in "256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336"; do
      set -- $s
      timeout 30 "$(bin $n)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 1,8,32 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench_cmp.log"
    done
  done
  for t in 1 8; do
    echo "== trace Qwen3 T=$t" >> "$L/trace.txt"
    timeout 30 .devbin/megamoe_trace bench --backend cuda --format nvfp4 --experts 128 --top-k 8 --hidden 2048 \
      --inter 768 --tokens $t --iters 10 >> "$L/trace.txt" 2>&1
  done
  for g in stream ws ws64; do tg $g; done
  san memcheck ws
  for fmt in nvfp4 bf16; do
    for s in "256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336"; do
      set -- $s
      timeout 90 .devbin/megamoe bench --backend cuda --format $fmt --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 1,8,32,128,512,2048,8192 --iters 10 >> "$L/bench_table.log" 2>&1
    done
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  MEGAMOE_CLI=.devbin/megamoe timeout 120 python3 -m pytest -q -p no:cacheprovider -rs \
    tests/py/test_multi_gpu.py > "$L/multi_gpu.txt" 2>&1
  echo "multi-GPU: $(tail -n 1 "$L/multi_gpu.txt") at $(el) s"
) > "$L/both.txt" 2>&1
grep -A12 "gate/up (us" "$L/trace.txt" | grep -E "==|streamed|first chunk|done" ; grep -E "==|streamed|first chunk  " "$L/trace.txt" | head -20
call_finish
