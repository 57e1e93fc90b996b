#!/usr/bin/env bash
# Prepared in session 16 for the next session (nvidia-h200-x2, carry .devpack, timeout_s 600; ~8.5 min
# plus the start; on one H200 run it as PART=0 then PART=1, two calls). Builds (packed in .devpack at
# session 16's end with call6.sh's; rebuild with):
#   bash bench/stage_device.sh && TESTS=1 bash bench/build_variants.sh "n128@wip/bf16-promote-n128=" && bash bench/pack_devbin.sh
# 1. bench/full_suite.sh on main (8b6678b or later: the promoted BF16 gate/up of DECISIONS 85 and the
#    column decode of DECISIONS 86 together, every test mode and sanitizer, both tables on one build).
# 2. n128 = wip/bf16-promote-n128: the ws kernel's BF16 promotion as one chain per group over all
#    128 tokens (two waits per K step instead of four; no spill): test_gpu ws / ws64 and memcheck ws
#    on GPU 0; BF16 main / n128 at T = 2048, 8192 on GPU 1 (DECISIONS 85: the promotion cost the ws
#    kernel's prefill 3-16%). Land it if it is faster and its tests pass.
. bench/call_lib.sh
extra_gpu0() {
  tg test_gpu_n128 ws
  tg test_gpu_n128 ws64
  san memcheck test_gpu_n128 ws
}
extra_gpu1() {
  FMT=bf16 CMP_TIMEOUT=90 cmp_bench bench_n128_bf16.log 2048,8192 main n128
  echo "n128 cmp done at $(el) s"
}
. bench/full_suite.sh
