#!/usr/bin/env bash
# Prepared for the next session (not run: session 15's device time was spent). nvidia-h200, carry
# .devpack, timeout_s 80. Does test_gpu catch a p row never sent? Build the mutant first:
#   TESTS=1 bash bench/build_variants.sh "mut@wip/mutant-skip=" && bash bench/pack_devbin.sh
# wip/mutant-skip = main with the poisoned p / act (merged) and the staged down epilogue skipping
# token column 1 of every block: test_gpu ws must FAIL (NaN rows where the CPU has none).
. bench/call_lib.sh
export CUDA_VISIBLE_DEVICES=0
MEGAMOE_GEMM=ws timeout 60 .devbin/test_gpu_mut > "$L/test_gpu_mut_ws.log" 2>&1; echo "exit $? (must be nonzero)"
grep -E "FAILED|not written|NaN|rel L2" "$L/test_gpu_mut_ws.log" | head -8
