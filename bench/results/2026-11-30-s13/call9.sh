#!/usr/bin/env bash
# Session 13, call 9 (nvidia-h200-x2, carry .devpack, timeout_s 230; the session's last ~5 min of
# device time): the chunked routing (sm90_route.cu: count / scan / fill over chunks of 2048 slots,
# replacing the per-expert scans that cost ~0.33 ms at Qwen3-like T = 8192, call 6's profile).
# Builds: bash bench/stage_device.sh && bash bench/pack_devbin.sh (main's working tree).
# GPU 0: test_gpu auto (the new > 4096-slot grid cases; NCCL 1-rank runs every case through it),
# then memcheck and racecheck auto (--quick: the NCCL one-token cases run it).
# GPU 1: the NVFP4 table's prefill columns on the three shapes (call 7's main beside it), then the
# per-kernel profile at Qwen3 T = 8192. Both: the 2-GPU pytest (NCCL routes every forward this way).
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  tg test_gpu auto
  san memcheck test_gpu auto
  san racecheck test_gpu auto
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for s in "${SHAPES3[@]}"; do
    set -- $s
    timeout 40 .devbin/megamoe bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
      --tokens 512,2048,8192 --iters 10 >> "$L/bench_prefill.log" 2>&1
  done
  OUT=$L/prof timeout 50 bash bench/profile.sh nvfp4 "128 8 2048 768" 8192 > "$L/profile.txt" 2>&1
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
multi_gpu main > "$L/both.txt" 2>&1
call_finish
grep -E "route|stage" "$L/profile.txt" | head -12
