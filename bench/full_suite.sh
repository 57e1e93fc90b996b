#!/usr/bin/env bash
# The whole GPU verification and both benchmark tables in one device call on nvidia-h200-x2 (~6 min;
# 334 s in session 11), for the build staged by bench/stage_device.sh (then bench/pack_devbin.sh;
# carry .devpack). Run from the repo root on the GPU machine: bash bench/full_suite.sh
# GPU 0: test_gpu auto / mma / wgmma, memcheck auto / stream / wgmma, racecheck auto / mma / wgmma.
# GPU 1: test_gpu stream / ws / ws64, memcheck ws, then the NVFP4 and BF16 tables (three shapes, T = 1-8192).
# Both: the 2-GPU pytest (two GPUs only). Logs under $OUT/logs (tarred), the step lines and the tables printed last.
# A call's script may define extra_gpu0 / extra_gpu1 (shell functions, run after each GPU's part,
# e.g. a variant's tests and cmp_bench) and then source this file.
# On a one-GPU machine the two parts run one after the other on GPU 0 and the 2-GPU pytest is left
# out (said so in both.txt); together they pass the 10-minute call limit there, so run them as two
# calls: PART=0 bash bench/full_suite.sh, then PART=1.
. bench/call_lib.sh
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
G1=1; [ "$NGPU" -lt 2 ] && G1=0
PART=${PART:-both}
[ "$PART" != 1 ] && (
  export CUDA_VISIBLE_DEVICES=0
  for g in auto mma wgmma; do tg test_gpu $g; done
  for g in auto stream wgmma; do san memcheck test_gpu $g; done
  for g in auto mma wgmma; do san racecheck test_gpu $g; done
  if declare -F extra_gpu0 >/dev/null; then extra_gpu0; fi
  echo "gpu0 done at $(el) s"
) > "$L/gpu0.txt" 2>&1 &
[ "$G1" = 0 ] && wait
[ "$PART" != 0 ] && (
  export CUDA_VISIBLE_DEVICES=$G1
  for g in stream ws ws64; do tg test_gpu $g; done
  san memcheck test_gpu ws
  for fmt in nvfp4 bf16; do
    for s in "${SHAPES3[@]}"; do
      set -- $s
      timeout 90 .devbin/megamoe bench --backend cuda --format $fmt --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 1,8,32,128,512,2048,8192 --iters 10 >> "$L/bench_table.log" 2>&1
    done
  done
  if declare -F extra_gpu1 >/dev/null; then extra_gpu1; fi
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
if [ "$NGPU" -ge 2 ] && [ "$PART" = both ]; then multi_gpu main > "$L/both.txt" 2>&1
else echo "multi-GPU: not run ($NGPU GPU(s) on this machine, PART=$PART)" > "$L/both.txt"; fi
call_finish
