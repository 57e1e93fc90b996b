#!/usr/bin/env bash
# Session 11, call 3 (nvidia-h200-x2). Builds (here, main 7d0ed09 = wip/stream-b5 merged):
#   bash bench/stage_device.sh   (call 2's .devbin, kept)
#   TESTS=1 bash bench/build_variants.sh "ca@wip/compact-finish=-DMM_STREAM_COMPACT_EPILOGUE=2"
#   bash bench/build_variants.sh "cf@wip/compact-finish=" "m@main=" "tracecf@wip/compact-finish=-DMM_STREAM_TRACE=1" \
#     "traceca@wip/compact-finish=-DMM_STREAM_TRACE=1 -DMM_STREAM_COMPACT_EPILOGUE=2"
#   bash bench/pack_devbin.sh
# Call 2's trace showed the split-K hand-off short (stored -> counted ~1 us) and the finisher's
# epilogue ~6 us, ending at one common instant on every SM: the unrolled epilogue's ~13 KB of code
# fetched cold (the L2 flush evicts code too) by all SMs at once? wip/compact-finish gives
# gemm_epilogue a COMPACT form (its column loop not unrolled, the values rotating through registers):
# cf = in the split-K finisher only; ca = also after an unsplit streaming item; m = main (b5 merged).
# GPU 0: test_gpu ca auto / stream (both compact forms), memcheck ca stream.
# GPU 1: m / cf / ca alternating twice at T = 1, 8, 32, 128 on the three shapes; traces of cf and ca at T = 1.
. bench/call_lib.sh
bin() { echo ".devbin/megamoe_$1"; }
(
  export CUDA_VISIBLE_DEVICES=0
  for g in auto stream; do tg test_gpu_ca $g; done
  san memcheck test_gpu_ca stream
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for n in m cf ca m cf ca; do
    for s in "128 8 2048 768" "8 2 4096 14336" "256 8 7168 2048"; do
      set -- $s
      timeout 40 "$(bin $n)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 1,8,32,128 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench1.log"
    done
  done
  for n in tracecf traceca; do
    for s in "128 8 2048 768 1" "8 2 4096 14336 1" "256 8 7168 2048 1"; do
      set -- $s
      echo "== $n E=$1 K=$2 H=$3 I=$4 T=$5" >> "$L/trace.txt"
      timeout 30 "$(bin $n)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 \
        --inter $4 --tokens $5 --iters 10 >> "$L/trace.txt" 2>&1
    done
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
grep -E "^==|  (setup|first copy|first full|streamed|counted|summed|first chunk) " "$L/trace.txt"
call_finish
