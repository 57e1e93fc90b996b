#!/usr/bin/env bash
# Session 10 call 1 (nvidia-h200-x2): session 9's prepared call8.sh, run as is.
# Builds (here): bash bench/stage_device.sh (main); then
#   TESTS=1 bash bench/build_variants.sh "xga@wip/stream-xgroup="
#   bash bench/build_variants.sh "xgnever@wip/stream-xgroup=-DST_XG_MIN_COLS=17" \
#     "xgreg@wip/stream-xgroup=-DST_XLIN=0" "xgall@wip/stream-xgroup=-DST_XG_MIN_COLS=1" \
#     "ms4=-DMM_STREAM_MIN_SPLIT_STEPS=4" "trace=-DMM_STREAM_TRACE=1"
#   TESTS=1 bash bench/build_variants.sh "wn1@wip/wgmma-narrow="
#   bash bench/build_variants.sh "wn2@wip/wgmma-narrow=-DMM_WGMMA_NARROW=2"
#   bash bench/pack_devbin.sh
# 1. wip/stream-xgroup (DECISIONS 59) in its linear layout (ST_XLIN, the default now: a slot's token
#    rows at base + slot * 128; the per-group regions of call 7, xgreg, cost 1-token chunks 3-6.5%):
#    xga = groups of 4 K steps per copy from 3 tokens, xgnever = the layout only, xgall = every chunk
#    grouped; main on both GPUs as the baseline. test_gpu xga stream / auto and memcheck first (the
#    linear layout has not run yet). DSv3 T = 8, 32, 128, 256, Mixtral T = 8, 32, Qwen3 T = 8, 32, 128.
# 2. ms4 = main splitting K down to 4 steps per split (Qwen3's 12-step down projection splits at
#    T = 1) against main at T = 1, 8, 32 on the three shapes.
# 5. wip/wgmma-narrow: the NVFP4 wgmma kernel with m64n32k16 for tiles of <= 32 tokens (wn1; wn2 also
#    m64n16k16 for <= 16) against main where wgmma runs: DSv3 T = 512, 1024, Qwen3 T = 256, 512,
#    Mixtral T = 64 (and T = 128 forced); test_gpu wn1 wgmma / auto first (GPU 0).
# 4. dev/sm90_accum_probe: wgmma / mma.sync / ordered f32 FMA against float64 on 64 x 64 x K BF16
#    products (DECISIONS 56's claim about the tensor cores' accumulation), GPU 0.
# 3. trace = main with the streaming blocks' timeline (printed at exit, for the last forward): Qwen3
#    T = 1 and 8, DSv3 T = 1, Mixtral T = 32, one T per run.
. bench/call_lib.sh
bin() { [ "$1" = main ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
cells() { # label binary: the streaming cells
  local n=$2
  timeout 30 "$(bin $n)" bench --backend cuda --format nvfp4 --experts 256 --top-k 8 --hidden 7168 --inter 2048 \
    --tokens 8,32,128,256 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/$1"
  timeout 20 "$(bin $n)" bench --backend cuda --format nvfp4 --experts 8 --top-k 2 --hidden 4096 --inter 14336 \
    --tokens 8,32 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/$1"
  timeout 20 "$(bin $n)" bench --backend cuda --format nvfp4 --experts 128 --top-k 8 --hidden 2048 --inter 768 \
    --tokens 8,32,128 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/$1"
}
(
  export CUDA_VISIBLE_DEVICES=0
  for g in stream auto; do
    MEGAMOE_GEMM=$g timeout 70 .devbin/test_gpu_xga > "$L/test_gpu_xga_$g.log" 2>&1
    echo "test_gpu xga $g: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_xga_$g.log" | tr '\n' ' ') at $(el) s"
  done
  MEGAMOE_GEMM=stream timeout 50 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    .devbin/test_gpu_xga --quick > "$L/memcheck_xga.log" 2>&1
  echo "memcheck xga stream: exit $? $(tail -n 1 "$L/memcheck_xga.log") at $(el) s"
  for n in main xgreg; do cells bench0.log $n; done
  for s in "128 8 2048 768 1" "128 8 2048 768 8" "256 8 7168 2048 1" "8 2 4096 14336 32"; do
    set -- $s
    echo "== trace E=$1 K=$2 H=$3 I=$4 T=$5" >> "$L/trace.txt"
    timeout 30 .devbin/megamoe_trace bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 \
      --inter $4 --tokens $5 --iters 10 2>&1 | grep -v "^bench:" >> "$L/trace.txt"
  done
  for g in wgmma auto; do
    MEGAMOE_GEMM=$g timeout 70 .devbin/test_gpu_wn1 > "$L/test_gpu_wn1_$g.log" 2>&1
    echo "test_gpu wn1 $g: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_wn1_$g.log" | tr '\n' ' ') at $(el) s"
  done
  timeout 30 .devbin/sm90_accum_probe > "$L/accum_probe.txt" 2>&1
  echo "accum probe: exit $? at $(el) s"
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for n in main xga xgnever xgall; do cells bench1.log $n; done
  for n in main ms4; do
    for s in "128 8 2048 768" "256 8 7168 2048" "8 2 4096 14336"; do
      set -- $s
      timeout 30 "$(bin $n)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 1,8,32 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench_ms4.log"
    done
  done
  for n in main wn1 wn2; do
    for s in "256 8 7168 2048 512,1024 auto" "128 8 2048 768 256,512 auto" "8 2 4096 14336 64 auto" "8 2 4096 14336 128 wgmma"; do
      set -- $s
      timeout 40 "$(bin $n)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens $5 --iters 10 --gemm $6 2>&1 | sed "s/^bench:/bench[$n $6]:/" >> "$L/bench_wn.log"
    done
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
cat "$L/trace.txt" "$L/accum_probe.txt" 2>/dev/null
call_finish
