#!/usr/bin/env bash
# Session 16, call 4 (nvidia-h200-x2, carry .devpack, timeout_s 300). main (staged) = wip/bf16-promote
# at 5b7af40: call 3's build with the wgmma kernel's BF16 gate/up promotion as one chain per group
# (192 registers; call 3's 254-register form could not run beside test_gpu's occupier). Only the two
# BF16 gate/up wgmma kernels differ from call 3's build (cuobjdump -sass per function). Builds:
#   bash bench/stage_device.sh && bash bench/pack_devbin.sh
# GPU 0: test_gpu wgmma forced, racecheck wgmma. GPU 1: memcheck wgmma, then auto.
# Both: the 2-GPU pytest (the NCCL loop forms of the promoted kernels; its prefill case runs ws).
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  tg test_gpu wgmma
  san racecheck test_gpu wgmma
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  san memcheck test_gpu wgmma
  san memcheck test_gpu auto
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
multi_gpu main > "$L/both.txt" 2>&1
call_finish
