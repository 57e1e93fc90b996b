#!/usr/bin/env bash
# Prepared in session 16 for the next session (nvidia-h200-x2, carry .devpack, timeout_s 420; ~5 min
# plus the start). pp = wip/ws-pingpong with the K loops in item order (a `kdone` barrier, bde19aa or
# later): the hang of session 16's call 2 read as a parity alias -- a consumer warpgroup back from its
# epilogue waited on `full` for its next item's first steps while the stages still held the other
# warpgroup's unfilled steps a lap earlier, so the wait passed on the old phase (DECISIONS 87).
# pp2 = the same with WS_PINGPONG=2 (the NCCL loop form too). Both predate the BF16 promotion and the
# column decode of main: compare NVFP4 only. Builds (after call5's):
#   TESTS=1 bash bench/build_variants.sh "pp@wip/ws-pingpong=-DWS_PINGPONG=1" && \
#   bash bench/build_variants.sh "pp2@wip/ws-pingpong=-DWS_PINGPONG=2" && bash bench/pack_devbin.sh
# GPU 0: test_gpu_pp ws / auto, memcheck ws. GPU 1: NVFP4 main / pp twice at T = 512, 2048, 8192 (the
# ws kernel's points: Mixtral T >= 512, DSv3 T >= 2048; Qwen3 and DSv3 T = 512 take wgmma). Both
# GPUs: the 2-GPU pytest with pp2. If pp passes and is faster: rebase it onto main (staged_epilogue,
# the promotion), fold its producer / K step with the one-item kernel's, test ws64, full suite.
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  tg test_gpu_pp ws
  tg test_gpu_pp auto
  san memcheck test_gpu_pp ws
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  cmp_bench bench_pp.log 512,2048,8192 main pp main pp
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
multi_gpu pp2 > "$L/both.txt" 2>&1
call_finish
