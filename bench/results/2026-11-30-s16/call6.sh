#!/usr/bin/env bash
# Prepared in session 16 for the next session (nvidia-h200-x2, carry .devpack, timeout_s 480; ~6.5 min
# plus the start). ppr = wip/ws-pingpong-r: the ws kernel's ping-pong form (WS_PINGPONG=1) rebased
# onto main (staged_send beside staged_epilogue, main's BF16 promotion in its K step) with the hang of
# session 16's call 2 fixed -- a parity alias: a consumer warpgroup back from its epilogue waited on
# `full` for its next item's first steps while the stages still held the other warpgroup's unfilled
# steps a ring lap earlier, so the wait passed on the old phase; the K loops now run in item order
# (a `kdone` barrier; DECISIONS 87). ppr2 = the same with WS_PINGPONG=2 (the NCCL loop form too).
# Builds (packed in .devpack at session 16's end with call5.sh's; rebuild with):
#   bash bench/stage_device.sh && TESTS=1 bash bench/build_variants.sh "n128@wip/bf16-promote-n128=" \
#     "ppr@wip/ws-pingpong-r=-DWS_PINGPONG=1" && bash bench/build_variants.sh "ppr2@wip/ws-pingpong-r=-DWS_PINGPONG=2" \
#     && bash bench/pack_devbin.sh
# GPU 0: test_gpu_ppr ws / auto, memcheck ws. GPU 1: NVFP4 main / ppr twice at T = 512, 2048, 8192 (the
# ws kernel's points: Mixtral T >= 512, DSv3 T >= 2048; Qwen3 and DSv3 T = 512 take wgmma), BF16
# main / ppr at T = 2048, 8192. Both GPUs: the 2-GPU pytest with ppr2. If ppr passes and is faster:
# fold its producer / K step with the one-item kernel's (`duplicates`), test ws64, run the full suite.
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  tg test_gpu_ppr ws
  tg test_gpu_ppr auto
  san memcheck test_gpu_ppr ws
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  cmp_bench bench_ppr.log 512,2048,8192 main ppr main ppr
  FMT=bf16 CMP_TIMEOUT=90 cmp_bench bench_ppr_bf16.log 2048,8192 main ppr
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
multi_gpu ppr2 > "$L/both.txt" 2>&1
call_finish
