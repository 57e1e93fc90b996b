#!/usr/bin/env bash
# Session 9, call 1 (nvidia-h200-x2), as prepared in session 8. Builds, here:
#   bash bench/stage_device.sh
#   TESTS=1 bash bench/build_variants.sh "gskip@wip/gather-cap=" "xf@wip/ws-xf="
#   bash bench/build_variants.sh "pfd@wip/prefetch-down=" "pfd0@wip/prefetch-down=-DMM_PREFETCH_DOWN_BYTES=0" \
#     "pfd48@wip/prefetch-down=-DMM_PREFETCH_DOWN_BYTES=50331648"   (for call2.sh; one pack for both)
#   bash bench/pack_devbin.sh
# then, device tool with carry .devpack: bash bench/results/<new date>/call1.sh (a copy of this file).
# GPU 0: test_gpu xf (wip/ws-xf, the NVFP4 ws transform variant) with ws forced, main with mma /
# wgmma / stream forced (the landed code ran auto, ws, ws64), gskip auto, xf auto, racecheck main
# mma / wgmma. GPU 1: xf against main on NVFP4 prefill (and Qwen3 with ws forced), what the TMA
# token tiles changed (BF16 DSv3 and Qwen3, NVFP4 Mixtral T = 128 / 512), the kernel thresholds
# (each GEMM kernel forced; auto's figures are in BENCHMARKS), the down weights' L2 prefetch at decode (pfd / pfd0 = its knob off, the same code
# otherwise; pfd48 a 48 MB cap). Both: the 2-GPU pytest on gskip, EP2 DSv3 T = 1…512, 8192 on
# gskip. A second call: the 2-GPU pytest on main (its new prefill case) and EP2 main at T = 32…512
# for the threshold.
. bench/call_lib.sh
bin() { [ "$1" = main ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
(
  export CUDA_VISIBLE_DEVICES=0
  for run in "xf ws" "main mma" "main wgmma" "main stream" "gskip auto" "xf auto" "xf ws64"; do
    set -- $run
    tb=.devbin/test_gpu; [ $1 = main ] || tb=.devbin/test_gpu_$1
    left=$(( 400 - $(el) )); [ $left -gt 30 ] || { echo "test_gpu $1 $2: not run (time)"; continue; }
    MEGAMOE_GEMM=$2 timeout $(( left < 80 ? left : 80 )) $tb > "$L/test_gpu_$1_$2.log" 2>&1
    echo "test_gpu $1 $2: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_$1_$2.log" | tr '\n' ' ') at $(el) s"
  done
  for g in mma wgmma; do
    MEGAMOE_GEMM=$g timeout 40 compute-sanitizer --tool racecheck --report-api-errors no --error-exitcode 9 \
      "${RACECHECK_EXCLUDE[@]}" .devbin/test_gpu --quick > "$L/racecheck_$g.log" 2>&1
    echo "racecheck $g: exit $? $(tail -n 1 "$L/racecheck_$g.log") at $(el) s"
  done
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  b() { # label gemm fmt tokens E K H I
    local lab=$1 k=$2 fmt=$3 tok=$4; shift 4
    timeout ${TL:-60} .devbin/megamoe bench --backend cuda --format $fmt --experts $1 --top-k $2 --hidden $3 --inter $4 \
      --tokens $tok --iters 10 --gemm $k 2>&1 | sed "s/^bench:/bench[$lab $k]:/" >> "$L/bench1.log"
  }
  for n in xf main; do # the transform variant against main on NVFP4 prefill
    for s in "256 8 7168 2048" "8 2 4096 14336"; do
      set -- $s
      timeout 40 "$(bin $n)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 2048,8192 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench1.log"
    done
  done
  timeout 40 .devbin/megamoe_xf bench --backend cuda --format nvfp4 --experts 128 --top-k 8 --hidden 2048 --inter 768 \
    --tokens 512,2048,8192 --iters 10 --gemm ws 2>&1 | sed "s/^bench:/bench[xf ws]:/" >> "$L/bench1.log"
  TL=120 b main auto bf16 2048,8192 256 8 7168 2048
  b main auto bf16 2048,8192 128 8 2048 768
  b main auto nvfp4 128,512 8 2 4096 14336
  for k in wgmma ws ws64; do b main $k nvfp4 256,512,1024 256 8 7168 2048; done
  for k in ws ws64; do b main $k nvfp4 512,2048,8192 128 8 2048 768; done
  echo "bench1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  left=$(( 570 - $(el) ))
  if [ $left -gt 60 ]; then
    MEGAMOE_CLI=.devbin/megamoe timeout $left python3 -m pytest -q -p no:cacheprovider -rs tests/py/test_multi_gpu.py \
      > "$L/multi_gpu_main.txt" 2>&1
    echo "multi-GPU main: $(tail -n 1 "$L/multi_gpu_main.txt") at $(el) s"
  else echo "multi-GPU main: not run (time)"; fi
) > "$L/both.txt" 2>&1
call_finish
