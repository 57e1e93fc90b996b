#!/usr/bin/env bash
# Prepared in session 13 as the next session's first call (nvidia-h200-x2, carry .devpack,
# timeout_s 600; ~8-9 min). Builds (main 11da092 = session 13's):
#   bash bench/stage_device.sh
#   TESTS=1 bash bench/build_variants.sh "rc2s128@wip/route-chunks2=-DROUTE_SMALL_SLOTS=128"
#   bash bench/build_variants.sh "rc2@wip/route-chunks2=" "rc2s1k@wip/route-chunks2=-DROUTE_SMALL_SLOTS=1024" "s12@d2ae08f="
#   TESTS=1 bash bench/build_variants.sh "tord@wip/tile-order="
#   TESTS=1 bash bench/build_variants.sh "gp@wip/guess-prefetch="
#   bash bench/build_variants.sh "gprt@wip/route-trigger="
#   bash bench/pack_devbin.sh
# rc2 = wip/route-chunks2: the chunked routing (DECISIONS 75) with the scan's eight loads ahead of
#   its stores (its rewrite pass waited an L2 latency per chunk: 11.6 us at Qwen3 T = 8192) and the
#   fill kernel's scales and first rows loaded with the ids (it loaded a scale per round: 10 us).
# rc2s1k / rc2s128: rc2 with the one-kernel routing only up to 1024 / 128 slots (4096 on main), so
#   the chunked routing also runs at Qwen3 T = 512 (4096 slots; 3.5% behind Marlin) / T = 32 and
#   128 (256 and 1024 slots; T = 128 6.4% behind). rc2s128's test_gpu runs nearly every one-process
#   case through the chunked routing (on main only two cases and the NCCL runs reach it).
# tord = wip/tile-order: the one-kernel routing also writes the tiles by tokens, most first, and the
#   NVFP4 streaming kernel walks its items in that order (longest processing time first: at Qwen3
#   T = 128 its blocks of 3 items each finish between 64 and 100 us, call 5's trace), from 128 slots
#   up to 8 per expert in one process (Qwen3 T = 32 / 128, DSv3 T = 32 / 128).
# gp = wip/guess-prefetch: with 8-16 slots per expert on one local rank, gate/up's producer prefetches
#   its first item's first 8 weight steps into L2 before its wait, guessing tile t = expert t
#   (Mixtral T = 32: no weight moves for ~13 us after the stage kernel's entry; 1.3% behind Marlin).
# gprt = wip/route-trigger (on gp): the one-kernel routing lets gate/up in at its start, so the
#   guessed prefetch also runs where a routing kernel follows the stage kernel (Qwen3 T = 128: ~12 us
#   of stage and routing before gate/up enters). Untested here: the landing's full suite tests it.
# s12 = d2ae08f (session 12's main): BF16 DSv3 T = 2048 / 8192 and Mixtral T = 8192 measured 2.5-8%
#   slower in session 13's call 7 with no BF16 kernel change -- machine or regression?
# GPU 0: rc2s128 test_gpu auto, memcheck and racecheck auto; tord test_gpu stream (the ordered
#   walk runs where the streaming kernel does, forced or not), memcheck stream; gp test_gpu stream;
#   then BF16 main / s12 twice at T = 2048, 8192 (FMT=bf16 cmp_bench).
# GPU 1: NVFP4 main / rc2 / rc2s1k / rc2s128 twice at T = 32, 128, 512, 2048, 8192; the per-kernel
#   profile of main and rc2s128 at Qwen3 T = 128, 512 (is the routing the gap there?); main / tord
#   twice at T = 32, 128; main / gp / gprt twice at T = 8, 32, 128.
# Then (next call) land what holds and run bench/full_suite.sh on the merged main.
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  tg test_gpu_rc2s128 auto
  san memcheck test_gpu_rc2s128 auto
  san racecheck test_gpu_rc2s128 auto
  tg test_gpu_tord stream
  san memcheck test_gpu_tord stream
  tg test_gpu_gp stream
  FMT=bf16 CMP_TIMEOUT=90 cmp_bench bench_bf16.log 2048,8192 main s12 main s12
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  cmp_bench bench_route.log 32,128,512,2048,8192 main rc2 rc2s1k rc2s128 main rc2 rc2s1k rc2s128
  for n in main rc2s128; do
    BIN=$(bin "$n") OUT=$L/prof_$n timeout 60 bash bench/profile.sh nvfp4 "128 8 2048 768" 128,512 \
      > "$L/profile_$n.txt" 2>&1
  done
  cmp_bench bench_tord.log 32,128 main tord main tord
  cmp_bench bench_gp.log 8,32,128 main gp gprt main gp gprt
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
call_finish
head -40 "$L"/profile_*.txt
