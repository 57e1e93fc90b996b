#!/usr/bin/env bash
# Prepared in session 10 as its call 7 (nvidia-h200-x2; not run: the session's device time was spent).
# Builds (here, on main 823d4a0 or later): bash bench/stage_device.sh; then
#   TESTS=1 bash bench/build_variants.sh "chain@wip/stream-chain="
#   bash bench/build_variants.sh "cpad@wip/stream-chain=-DMM_SPLITK_COUNTER_STRIDE=32" \
#     "trace=-DMM_STREAM_TRACE=1" "tracec@wip/stream-chain=-DMM_STREAM_TRACE=1" \
#     "b5s6=-DMM_STREAM_BLOCKS_PER_SM=5 -DST_STAGES=6 -DST_XG=3" "ms16=-DMM_STREAM_MIN_SPLIT_STEPS=16"
#   bash bench/pack_devbin.sh
# chain = wip/stream-chain: tile_rows (load_tile one memory latency, not two; every GEMM kernel but
#   ws reads tiles through it), the streaming kernel's tile counts read beside the token count, and
#   slot_scale (each slot row's activation scale written by the routing, read beside the slot code;
#   added after call 7q, which measured the branch without it: 1-1.5% on Qwen3 / Mixtral decode);
# cpad = chain with the split-K counters 128 B apart (DECISIONS 62's tail: same-line atomics?);
# b5s6 = main with 5 streaming blocks per SM of 6 ring stages, grouped copies of 3 steps (660
#   resident: Qwen3 T = 8's 564 gate/up items in one round; measured 2-4% slower in session 5);
# ms16 = main with splits of 16 K steps or more: only Qwen3 T = 1's gate/up changes (4 splits -> 2:
#   half the split-K hand-offs, whose tail is 7.5 us there, for twice the steps per block).
# GPU 0: test_gpu chain auto / stream / mma / wgmma (load_tile's readers), memcheck chain stream.
# GPU 1: main / chain / cpad / b5s6 / ms16 alternating twice at T = 1, 8, 32 on the three shapes; the trace of
#   main and chain at Qwen3 T = 1 and Mixtral T = 1 (setup -> first copy should shrink by one
#   latency per phase; the gate/up tail at its common instant with cpad's numbers beside); then
#   main's trace and times at T = 1 with no L2 flush (MEGAMOE_BENCH_FLUSH_MB=0, diagnosis only):
#   does the tail come from the flush's dirty lines being written back during the forward?
# Both: the 2-GPU pytest with chain (the routing kernels changed).
. bench/call_lib.sh
bin() { [ "$1" = main ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
(
  export CUDA_VISIBLE_DEVICES=0
  for g in auto stream mma wgmma; do
    MEGAMOE_GEMM=$g timeout 100 .devbin/test_gpu_chain > "$L/test_gpu_chain_$g.log" 2>&1
    echo "test_gpu chain $g: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_chain_$g.log" | tr '\n' ' ') at $(el) s"
  done
  MEGAMOE_GEMM=stream timeout 100 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    .devbin/test_gpu_chain --quick > "$L/memcheck_chain_stream.log" 2>&1
  echo "memcheck chain stream: exit $? $(tail -n 1 "$L/memcheck_chain_stream.log") at $(el) s"
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for n in main chain cpad b5s6 ms16 main chain cpad b5s6 ms16; do
    for s in "128 8 2048 768" "8 2 4096 14336" "256 8 7168 2048"; do
      set -- $s
      timeout 30 "$(bin $n)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 1,8,32 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench1.log"
    done
  done
  for n in trace tracec; do
    for s in "128 8 2048 768 1" "8 2 4096 14336 1"; do
      set -- $s
      echo "== $n E=$1 K=$2 H=$3 I=$4 T=$5" >> "$L/trace.txt"
      timeout 30 "$(bin $n)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 \
        --inter $4 --tokens $5 --iters 10 >> "$L/trace.txt" 2>&1
    done
  done
  for s in "128 8 2048 768" "8 2 4096 14336"; do
    set -- $s
    echo "== trace, no flush, E=$1 K=$2 H=$3 I=$4 T=1" >> "$L/trace.txt"
    MEGAMOE_BENCH_FLUSH_MB=0 timeout 30 .devbin/megamoe_trace bench --backend cuda --format nvfp4 --experts $1 \
      --top-k $2 --hidden $3 --inter $4 --tokens 1 --iters 10 >> "$L/trace.txt" 2>&1
  done
  for s in "128 8 2048 768" "8 2 4096 14336" "256 8 7168 2048"; do
    set -- $s
    MEGAMOE_BENCH_FLUSH_MB=0 timeout 30 .devbin/megamoe bench --backend cuda --format nvfp4 --experts $1 --top-k $2 \
      --hidden $3 --inter $4 --tokens 1,8 --iters 10 2>&1 | sed "s/^bench:/bench[main, no flush]:/" >> "$L/bench1.log"
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  MEGAMOE_CLI=.devbin/megamoe_chain timeout 120 python3 -m pytest -q -p no:cacheprovider -rs \
    tests/py/test_multi_gpu.py > "$L/multi_gpu_chain.txt" 2>&1
  echo "multi-GPU chain: $(tail -n 1 "$L/multi_gpu_chain.txt") at $(el) s"
) > "$L/both.txt" 2>&1
grep -E "^==|  (setup|first copy|first full|streamed|first chunk) " "$L/trace.txt"
call_finish
