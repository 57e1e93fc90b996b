#!/usr/bin/env bash
# Prepared in session 12 as the next session's second call (nvidia-h200-x2, carry .devpack, timeout_s
# 480; ~6-7 min): the NVFP4 prefill, where Marlin still leads on Qwen3 (T = 512-8192, 4.7-9.6%).
# Builds (with call5's, same .devpack):
#   TESTS=1 bash bench/build_variants.sh "bfp4@wip/wgmma-bfp4=" "rw@wip/stage-route-warp="
#   bash bench/pack_devbin.sh
# bfp4 = wip/wgmma-bfp4: the NVFP4 gate/up wgmma kernel copies the staged tokens' FP4 codes and scales
#   (2.3 KB per K step of a 64-token tile instead of 8 KB of x_f16) and decodes them into the 16-bit B
#   slot one step ahead, with the stage kernel's decode (y unchanged). Worth it if call5's ncu of the
#   wgmma kernel shows L2 / memory throughput near its ceiling; a cost in instructions otherwise.
#   New shared-memory hand-offs (codes -> decoded tile -> wgmma): racecheck with wgmma forced.
# rw = wip/stage-route-warp (on call5's sx): a one-token forward of one rank routes in an extra warp of
#   the stage block while the other threads quantize (the routing block took ~2.8 us after the
#   quantization at Qwen3 T = 1); new named-barrier hand-off: racecheck auto.
# GPU 0: test_gpu_bfp4 wgmma / auto, memcheck and racecheck wgmma; test_gpu_rw auto, memcheck and
#   racecheck auto.
# GPU 1: main / sx / rw twice at T = 1, 2, 8; main / bfp4 twice at T = 128-8192 on the three shapes (the wgmma kernel runs where the
#   table says: Qwen3 from T = 256, DSv3 / Mixtral in a middle range), and per-kernel times (ncu) of
#   main and bfp4 at Qwen3 T = 8192.
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  tg test_gpu_bfp4 wgmma
  tg test_gpu_bfp4 auto
  san memcheck test_gpu_bfp4 wgmma
  san racecheck test_gpu_bfp4 wgmma
  tg test_gpu_rw auto
  san memcheck test_gpu_rw auto
  san racecheck test_gpu_rw auto
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  cmp_bench bench1.log 128,512,2048,8192 main bfp4 main bfp4
  cmp_bench bench2.log 1,2,8 main sx rw main sx rw
  for n in main bfp4; do
    BIN=$(bin "$n") OUT=$L/prof_$n timeout 90 bash bench/profile.sh nvfp4 "128 8 2048 768" 8192 > "$L/profile_$n.txt" 2>&1
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
call_finish
