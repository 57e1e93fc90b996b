#!/usr/bin/env bash
# Prepared in session 14 for the next session (nvidia-h200-x2, carry .devpack, timeout_s 600; ~7 min
# plus the start). Builds (packed in .devpack at session 14's end; rebuild with):
#   bash bench/stage_device.sh                      # main (a4d2197 + documents)
#   TESTS=1 bash bench/build_variants.sh "l2a8@wip/stream-l2ahead="
#   bash bench/build_variants.sh "l2a4@wip/stream-l2ahead=-DMM_STREAM_L2_AHEAD=4" "l2a16@wip/stream-l2ahead=-DMM_STREAM_L2_AHEAD=16"
#   TESTS=1 bash bench/build_variants.sh "l2n8@wip/stream-l2ahead=-DMM_STREAM_L2_NEXT=1"
#   TESTS=1 bash bench/build_variants.sh "wl4@wip/wgmma-l2ahead="
#   bash bench/build_variants.sh "wl8@wip/wgmma-l2ahead=-DMM_WGMMA_L2_AHEAD=8"
#   bash bench/pack_devbin.sh
# l2aN = wip/stream-l2ahead: with each K step's copies the streaming producer prefetches the weights
#   N steps further into L2 (cp.async.bulk.prefetch.L2, within the item). Call 7's per-instruction
#   sampling: the consumers' waits on the ring's full barriers are a third of gate/up's warp samples
#   at Qwen3 T = 128 (46% of down's at Mixtral T = 32), DRAM at 47% -- the ring's 8 steps in flight
#   per block do not cover the latency. Items of fewer than N + 1 steps (the split items of T = 1)
#   issue no prefetch. l2n8: l2a8 and the block's next item's first 8 steps prefetched 8 steps before
#   the item's end (call 7: ~30% of the ring waits are at an item's first step).
# wlN = wip/wgmma-l2ahead: the same for the NVFP4 wgmma kernel (one process): with step kc's
#   cp.async copies the first lane of each slab's first warp prefetches the slab's step kc + N
#   (4 KB codes + 512 B scales) into L2 (the ring runs WG_STAGES - 2 = 3 steps ahead; gate/up at
#   Qwen3 T = 512 ran at DRAM 30%, call 2). Qwen3 T = 256 / 512 (1.6% behind Marlin at 512) and the
#   wgmma prefill cells.
# GPU 0: l2a8's test_gpu auto / stream and memcheck stream, l2n8's stream and memcheck stream (the
# producer's change; racecheck excludes this kernel); wl4's test_gpu wgmma, memcheck and racecheck
# wgmma. GPU 1: main / l2a4 / l2a8 / l2a16 / l2n8 twice at T = 1, 8, 32, 128 (the streaming regime);
# main / wl4 / wl8 twice at T = 256, 512, 2048.
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  stream_checks test_gpu_l2a8
  tg test_gpu_l2n8 stream
  san memcheck test_gpu_l2n8 stream
  tg test_gpu_wl4 wgmma
  san memcheck test_gpu_wl4 wgmma
  san racecheck test_gpu_wl4 wgmma
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  cmp_bench bench_l2a.log 1,8,32,128 main l2a4 l2a8 l2a16 l2n8 main l2a4 l2a8 l2a16 l2n8
  cmp_bench bench_wl.log 256,512,2048 main wl4 wl8 main wl4 wl8
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
call_finish
