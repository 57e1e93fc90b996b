#!/usr/bin/env bash
# Session 11, call 2 (nvidia-h200-x2). Builds (here, main 4b68996 = session 10's call 7 branch merged):
#   bash bench/stage_device.sh
#   TESTS=1 bash bench/build_variants.sh "b5@wip/stream-b5="
#   bash bench/build_variants.sh "pf@wip/handoff-pf=-DMM_STREAM_PREFETCH_HANDOFF=1" \
#     "trace@wip/handoff-pf=-DMM_STREAM_TRACE=1" "tracep@wip/handoff-pf=-DMM_STREAM_TRACE=1 -DMM_STREAM_PREFETCH_HANDOFF=1" \
#     "pfms6@wip/handoff-pf=-DMM_STREAM_PREFETCH_HANDOFF=1 -DMM_STREAM_MIN_SPLIT_STEPS=6"
#   bash bench/pack_devbin.sh
# b5 = wip/stream-b5: the streaming kernel's instantiation with 5 blocks per SM of 6 stages, chosen
#   per phase by plan_stream_more_blocks (Qwen3-like T = 8 gate/up only among the table's cells);
# pf = the producer prefetches its item's split-K counter and partial-sum lines into L2 at the item's
#   start (is the hand-off's tail -- a third of Qwen3 T = 1's gate/up blocks leaving at one common
#   instant ~7 us after streaming -- cold lines or address translations?);
# pfms6 = pf with splits of >= 6 K steps (Qwen3 T = 1 down in 2 splits, gate/up in 5);
# trace / tracep = the timeline build with stamps around the hand-off (stored, fenced, counted, summed),
#   without / with the prefetch.
# GPU 0: test_gpu b5 auto / stream, memcheck b5 stream. GPU 1: main / b5 / pf / pfms6 alternating
# twice at T = 1, 8, 32 on the three shapes; main / b5 at Qwen3 T = 4..16; main's Qwen3 T = 128..8192
# with each GEMM kernel forced (the choice there was measured sessions ago); the traces at T = 1.
. bench/call_lib.sh   # (the steps below written with call_lib's helpers after the call ran; the same steps)
(
  export CUDA_VISIBLE_DEVICES=0
  stream_checks test_gpu_b5
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  cmp_bench bench1.log 1,8,32 main b5 pf pfms6 main b5 pf pfms6
  for n in main b5 main b5; do
    timeout 30 "$(bin $n)" bench --backend cuda --format nvfp4 --experts 128 --top-k 8 --hidden 2048 --inter 768 \
      --tokens 4,6,7,9,10,12,16 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench2.log"
  done
  for g in wgmma ws ws64 auto; do
    timeout 60 .devbin/megamoe bench --backend cuda --format nvfp4 --experts 128 --top-k 8 --hidden 2048 --inter 768 \
      --tokens 128,512,2048,8192 --iters 10 --gemm $g 2>&1 | sed "s/^bench:/bench[main --gemm $g]:/" >> "$L/bench3.log"
  done
  for n in trace tracep; do trace_runs $n 1; done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
grep -E "^==|  (setup|first copy|first full|streamed|stored|fenced|counted|summed|first chunk) " "$L/trace.txt"
call_finish
