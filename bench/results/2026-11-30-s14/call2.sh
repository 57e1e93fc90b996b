#!/usr/bin/env bash
# Session 14, call 2 (nvidia-h200-x2, carry .devpack, timeout_s 600): the full suite on the merged
# main (wip/route-chunks2 with ROUTE_SMALL_SLOTS 1024, wip/tile-order), staged by
#   bash bench/stage_device.sh && bash bench/pack_devbin.sh
# extra_gpu1: the per-kernel profile at Qwen3 T = 128 (the ordered streaming walk) and 512 (now the
# chunked routing).
extra_gpu1() {
  OUT=$L/prof_main timeout 90 bash bench/profile.sh nvfp4 "128 8 2048 768" 128,512 > "$L/profile_main.txt" 2>&1
}
. bench/full_suite.sh
head -40 "$L/profile_main.txt"
