#!/usr/bin/env bash
# Prepared in session 8 for the second call of session 9 (nvidia-h200-x2; not yet run), with the same
# builds as next_call1.sh (one .devpack for both). GPU 0: the down weights' L2 prefetch at decode,
# pfd (24 MB cap) / pfd0 (its knob at 0, the same code otherwise) / pfd48 (48 MB), NVFP4 T = 1, 8, 32
# on the three shapes. Then both GPUs: the 2-GPU pytest on gskip (wip/gather-cap: gather only from
# 1024 slot rows per rank, a capped copy), EP2 DSv3 NVFP4 with T_max 8192 gskip / main at T = 1 … 512
# and 8192 (the threshold: the copy's cost against re-reading remote rows).
. bench/call_lib.sh
bin() { [ "$1" = main ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
(
  export CUDA_VISIBLE_DEVICES=0
  for n in pfd pfd0 pfd48; do
    for s in "128 8 2048 768" "256 8 7168 2048" "8 2 4096 14336"; do
      set -- $s
      timeout 40 "$(bin $n)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 1,8,32 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench1.log"
    done
  done
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1
(
  MEGAMOE_CLI=.devbin/megamoe_gskip timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/py/test_multi_gpu.py \
    > "$L/multi_gpu_gskip.txt" 2>&1
  echo "multi-GPU gskip: $(tail -n 1 "$L/multi_gpu_gskip.txt") at $(el) s"
  for n in gskip main; do
    left=$(( 585 - $(el) )); [ $left -gt 25 ] || break
    timeout $(( left < 80 ? left : 80 )) "$(bin $n)" bench --gpus 2 --format nvfp4 --experts 256 --top-k 8 --hidden 7168 \
      --inter 2048 --tokens 1,8,32,128,512,8192 --iters 10 2>&1 | sed "s/^bench:/bench[$n dsv3 tmax 8192]:/" >> "$L/nccl.log"
  done
) > "$L/both.txt" 2>&1
call_finish
