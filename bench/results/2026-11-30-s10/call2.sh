#!/usr/bin/env bash
# Session 10 call 2 (nvidia-h200-x2). Builds (here): bash bench/stage_device.sh (main with the narrow
# wgmma at its default 2 and the trace fix); bash bench/build_variants.sh "trace=-DMM_STREAM_TRACE=1";
# bash bench/pack_devbin.sh.
# GPU 0: test_gpu wgmma / auto, memcheck and racecheck with the wgmma kernel forced (the narrow
#        instructions are new; call 1 tested N 32 only).
# GPU 1: the streaming timeline (trace) at Qwen3 T = 1, 8, 32, DSv3 T = 1, Mixtral T = 1, 32; then
#        main's NVFP4 table (3 shapes x 7 T).
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  for g in wgmma auto; do
    MEGAMOE_GEMM=$g timeout 90 .devbin/test_gpu > "$L/test_gpu_$g.log" 2>&1
    echo "test_gpu $g: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_$g.log" | tr '\n' ' ') at $(el) s"
  done
  for tool in memcheck racecheck; do
    excl=(); [ $tool = racecheck ] && excl=("${RACECHECK_EXCLUDE[@]}")
    MEGAMOE_GEMM=wgmma timeout 150 compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 "${excl[@]}" \
      .devbin/test_gpu --quick > "$L/${tool}_wgmma.log" 2>&1
    echo "$tool wgmma: exit $? $(tail -n 1 "$L/${tool}_wgmma.log") at $(el) s"
  done
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for s in "128 8 2048 768 1" "128 8 2048 768 8" "128 8 2048 768 32" "256 8 7168 2048 1" "8 2 4096 14336 1" "8 2 4096 14336 32"; do
    set -- $s
    echo "== trace E=$1 K=$2 H=$3 I=$4 T=$5" >> "$L/trace.txt"
    timeout 30 .devbin/megamoe_trace bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 \
      --inter $4 --tokens $5 --iters 10 >> "$L/trace.txt" 2>&1
  done
  for s in "256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336"; do
    set -- $s
    timeout 120 .devbin/megamoe bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
      --tokens 1,8,32,128,512,2048,8192 --iters 10 >> "$L/bench1.log" 2>&1
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
cat "$L/trace.txt"
call_finish
