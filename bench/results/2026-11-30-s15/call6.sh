#!/usr/bin/env bash
# Session 15 call 6 (nvidia-h200, carry .devpack, timeout_s 250; the last of the session's device
# time): test_gpu of wip/poison-buffers (p and act set to NaN before every forward of the grid, so a
# row read but not written this forward shows in y) with the kernels chosen per forward, then ws,
# wgmma and mma.sync forced, as far as the time goes.
. bench/call_lib.sh
export CUDA_VISIBLE_DEVICES=0
(
  for g in auto ws wgmma mma; do tg test_gpu_pz $g; done
) > "$L/gpu0.txt" 2>&1
call_finish
