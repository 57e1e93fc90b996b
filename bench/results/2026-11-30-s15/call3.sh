#!/usr/bin/env bash
# Session 15 call 3 (nvidia-h200-x2, carry .devpack, timeout_s 600): bench/full_suite.sh on
# wip/ws-staged (staged as .devbin/megamoe and test_gpu: main 5242166 + the ws and wgmma kernels'
# epilogue through shared memory and bulk stores, WS_STAGED / WG_STAGED), with
#   GPU 0 after its part: BF16 m0 (= main 5242166) at T = 2048, 8192 (the table has the staged build's);
#   GPU 1 after its part: NVFP4 m0 / sstc (WS_STAGED_COMPACT=1: gate/up's staged epilogue as a loop,
#   call 2 had 47% of gate/up's epilogue samples on no_inst) / staged main, alternated, at T = 256, 512, 2048, 8192.
extra_gpu0() {
  FMT=bf16 CMP_TIMEOUT=90 cmp_bench bench_bf16.log 2048,8192 m0
  echo "bf16 m0 done at $(el) s"
}
extra_gpu1() {
  cmp_bench bench_sst.log 256,512,2048,8192 m0 main sstc m0 main sstc
  echo "nvfp4 cmp done at $(el) s"
}
. bench/full_suite.sh
