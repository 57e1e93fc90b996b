#!/usr/bin/env bash
# Session 9, call 2 (nvidia-h200-x2), as prepared in session 8 with the profiles added; the same
# builds as call1.sh (one .devpack for both). GPU 0: the down weights' L2 prefetch at decode,
# pfd (24 MB cap) / pfd0 (its knob at 0, the same code otherwise) / pfd48 (48 MB), NVFP4 T = 1, 8, 32
# on the three shapes. Then both GPUs: the 2-GPU pytest on gskip (wip/gather-cap: gather only from
# 1024 slot rows per rank, a capped copy), EP2 DSv3 NVFP4 with T_max 8192 gskip / main at T = 1 … 512
# and 8192 (the threshold: the copy's cost against re-reading remote rows). GPU 1 meanwhile: ncu
# per-kernel times of Qwen3 NVFP4 decode, stall reasons of the ws kernel (landed, xf) at DSv3 T = 8192.
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
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  # Qwen3 decode's per-kernel times (item 4) and the ws kernel's stall reasons, landed and xf (item 5).
  OUT=$L timeout 90 bash bench/profile.sh nvfp4 "128 8 2048 768" 1,8 > "$L/profile_qwen3.txt" 2>&1
  echo "profile qwen3: exit $? at $(el) s"
  OUT=$L timeout 120 bash bench/stalls.sh sm90_expert_ws_kernel "256 8 7168 2048" 8192 > "$L/stalls_ws.txt" 2>&1
  echo "stalls ws: exit $? at $(el) s"
  left=$(( 250 - $(el) ))
  [ $left -gt 60 ] && BIN=.devbin/megamoe_xf OUT=$L/xf timeout $left bash bench/stalls.sh sm90_expert_ws_xf_kernel "256 8 7168 2048" 8192 > "$L/stalls_xf.txt" 2>&1
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
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
