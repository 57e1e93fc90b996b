#!/usr/bin/env bash
# Session 10 call 7q (nvidia-h200-x2): the short form of call7.sh that the remaining ~4 minutes of
# device time allow (same builds and .devpack): test_gpu chain stream / auto on GPU 0; main / chain /
# cpad alternating twice at T = 1, 8, 32 and the traces of main and chain at Qwen3 T = 1 on GPU 1.
# No memcheck, other modes or 2-GPU pytest: those stay for call7.sh.
. bench/call_lib.sh
bin() { [ "$1" = main ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
(
  export CUDA_VISIBLE_DEVICES=0
  for g in stream auto; do
    MEGAMOE_GEMM=$g timeout 60 .devbin/test_gpu_chain > "$L/test_gpu_chain_$g.log" 2>&1
    echo "test_gpu chain $g: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_chain_$g.log" | tr '\n' ' ') at $(el) s"
  done
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for n in main chain cpad main chain cpad; do
    for s in "128 8 2048 768" "8 2 4096 14336" "256 8 7168 2048"; do
      set -- $s
      [ $(el) -lt 95 ] || break 2
      timeout 15 "$(bin $n)" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 1,8,32 --iters 10 2>&1 | sed "s/^bench:/bench[$n]:/" >> "$L/bench1.log"
    done
  done
  for n in trace tracec; do
    [ $(el) -lt 110 ] || break
    echo "== $n Qwen3 T=1" >> "$L/trace.txt"
    timeout 12 "$(bin $n)" bench --backend cuda --format nvfp4 --experts 128 --top-k 8 --hidden 2048 \
      --inter 768 --tokens 1 --iters 10 >> "$L/trace.txt" 2>&1
  done
  echo "gpu1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
grep -E "^==|  (setup|first copy|first full|streamed|first chunk) " "$L/trace.txt"
call_finish
