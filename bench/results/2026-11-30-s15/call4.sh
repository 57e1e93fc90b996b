#!/usr/bin/env bash
# Session 15 call 4 (nvidia-h200-x2, carry .devpack, timeout_s 360). Builds: main 68a1f66 (the staged
# epilogues, merged after call 3) and sstc (main -DWS_STAGED_COMPACT=1: the ws kernel's staged
# gate/up epilogue as gemm_epilogue's COMPACT loop; call 3: Mixtral T = 512 -6.4%, T = 256 +1.6%).
# GPU 0: sstc's test_gpu ws / ws64 and memcheck ws (its new instantiation: COMPACT and STAGED at 16
#   n-tiles). GPU 1: BF16 main / sstc at T = 2048, 8192; then whether the kernel choice should move
#   now that wgmma's epilogue is cheaper: NVFP4 auto (streaming up to 8 tokens per expert) against
#   wgmma forced at T = 32, 64, 128, twice.
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  tg test_gpu_sstc ws
  tg test_gpu_sstc ws64
  san memcheck test_gpu_sstc ws
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  FMT=bf16 CMP_TIMEOUT=90 cmp_bench bench_bf16.log 2048,8192 main sstc
  echo "bf16 done at $(el) s"
  for rep in 1 2; do
    for g in auto wgmma; do
      for s in "${SHAPES3[@]}"; do
        set -- $s
        timeout 40 .devbin/megamoe bench --backend cuda --format nvfp4 --gemm $g --experts $1 --top-k $2 --hidden $3 \
          --inter $4 --tokens 32,64,128 --iters 10 2>&1 | sed "s/^bench:/bench[$g]:/" >> "$L/bench_choice.log"
      done
    done
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
call_finish
