#!/usr/bin/env bash
# Session 14, call 3 (nvidia-h200-x2, carry .devpack, timeout_s 420). Builds: main 84e327f
# (bench/stage_device.sh) and
#   TESTS=1 bash bench/build_variants.sh "ch512=-DMM_ROUTE_CHUNK=512"
#   bash bench/build_variants.sh "ch1k=-DMM_ROUTE_CHUNK=1024" "s13@95c05e3="
#   bash bench/pack_devbin.sh
# ch512 / ch1k: the chunked routing over chunks of 512 / 1024 slots (2048 on main): at Qwen3 T = 512
#   (4096 slots, now routed by chunks) only 2 blocks count and fill (9.4 us fill, call 2's profile).
# s13 = session 13's last main: Qwen3 T = 1 read 0.0372 in call 2's table (0.0362 in session 13):
#   does the streaming kernel's tile-order argument cost at T = 1, or is it the machine?
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  tg test_gpu_ch512 auto
  san memcheck test_gpu_ch512 auto
  cmp_bench bench_decode.log 1,8 main s13 main s13 main s13
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  cmp_bench bench_chunk.log 256,512,2048,8192 main ch512 ch1k main ch512 ch1k
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
call_finish
