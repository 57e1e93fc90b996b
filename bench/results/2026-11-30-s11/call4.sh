#!/usr/bin/env bash
# Session 11, call 4 (nvidia-h200-x2): the whole suite and both tables on main 7bb2f4d (session 10's
# stream-chain, the 5-blocks-per-SM streaming instantiation, the compact streaming epilogues).
# Builds (here): bash bench/stage_device.sh; bash bench/pack_devbin.sh.
# GPU 0: test_gpu auto / mma / wgmma, memcheck auto / stream / wgmma, racecheck auto / mma / wgmma.
# GPU 1: test_gpu stream / ws / ws64, memcheck ws, then the NVFP4 and BF16 tables.
# Both: the 2-GPU pytest.
. bench/call_lib.sh
(
  export CUDA_VISIBLE_DEVICES=0
  for g in auto mma wgmma; do tg test_gpu $g; done
  for g in auto stream wgmma; do san memcheck test_gpu $g; done
  for g in auto mma wgmma; do san racecheck test_gpu $g; done
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for g in stream ws ws64; do tg test_gpu $g; done
  san memcheck test_gpu ws
  for fmt in nvfp4 bf16; do
    for s in "256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336"; do
      set -- $s
      timeout 90 .devbin/megamoe bench --backend cuda --format $fmt --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 1,8,32,128,512,2048,8192 --iters 10 >> "$L/bench_table.log" 2>&1
    done
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  MEGAMOE_CLI=.devbin/megamoe timeout 120 python3 -m pytest -q -p no:cacheprovider -rs \
    tests/py/test_multi_gpu.py > "$L/multi_gpu.txt" 2>&1
  echo "multi-GPU: $(tail -n 1 "$L/multi_gpu.txt") at $(el) s"
) > "$L/both.txt" 2>&1
call_finish
