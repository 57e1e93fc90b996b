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
. bench/call_lib.sh   # (the steps below written with call_lib's helpers after the call ran; the same steps)
(
  export CUDA_VISIBLE_DEVICES=0
  stream_checks test_gpu_ca
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  cmp_bench bench1.log 1,8,32,128 m cf ca m cf ca
  for n in tracecf traceca; do trace_runs $n 1; done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
grep -E "^==|  (setup|first copy|first full|streamed|counted|summed|first chunk) " "$L/trace.txt"
call_finish
