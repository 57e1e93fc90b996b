#!/usr/bin/env bash
# Session 14, call 4 (nvidia-h200-x2, carry .devpack, timeout_s 420): main with MM_ROUTE_CHUNK 512
# (call 3's ch512), staged by bench/stage_device.sh + bench/pack_devbin.sh. ch512's test_gpu auto and
# memcheck passed in call 3; here racecheck auto, the forced modes that call 3 did not run, the 2-GPU
# pytest (every NCCL forward routes by chunks) and the NVFP4 table.
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  san racecheck test_gpu auto
  tg test_gpu wgmma
  tg test_gpu stream
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for s in "${SHAPES3[@]}"; do
    set -- $s
    timeout 90 .devbin/megamoe bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
      --tokens 1,8,32,128,512,2048,8192 --iters 10 >> "$L/bench_table.log" 2>&1
  done
  tg test_gpu ws
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
multi_gpu main > "$L/both.txt" 2>&1
call_finish
