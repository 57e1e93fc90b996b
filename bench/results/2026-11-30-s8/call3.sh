#!/usr/bin/env bash
# Session 8 call 3 (nvidia-h200-x2): g = wip/gather (ranks on several GPUs copy each routed slot's
# gate/up input once into a slot-ordered region; one process unchanged), main = s8a. Built here:
#   bash bench/stage_device.sh   (on wip/gather: .devbin/megamoe, test_gpu)
#   bash bench/build_variants.sh "main@main="; bash bench/pack_devbin.sh
# GPU 0: test_gpu g auto, memcheck; ncu per-kernel times of Qwen3 T = 1, 8 and Mixtral T = 32 (for the
# decode fixed costs). GPU 1: Mixtral / Qwen3 NVFP4 mid cells with each kernel forced. Both: the 2-GPU
# pytest on g, EP2 DSv3 (T_max 8 and 8192) and Mixtral (T_max 4096) g against main, memcheck of EP2.
set -u
OUT=${OUT:-device-out}
L=$OUT/logs
mkdir -p "$L"
tar xJf .devpack/devbin.tar.xz
. bench/device_env.sh
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
bin() { [ "$1" = g ] && echo .devbin/megamoe || echo ".devbin/megamoe_$1"; }
(
  export CUDA_VISIBLE_DEVICES=0
  MEGAMOE_GEMM=auto timeout 90 .devbin/test_gpu > "$L/test_gpu_g_auto.log" 2>&1
  echo "test_gpu g auto: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_g_auto.log" | tr '\n' ' ') at $(el) s"
  timeout 60 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 .devbin/test_gpu --quick \
    > "$L/sanitize_g_memcheck.log" 2>&1
  echo "memcheck g auto: exit $? $(tail -n 1 "$L/sanitize_g_memcheck.log") at $(el) s"
  for p in "128 8 2048 768|1,8" "8 2 4096 14336|1,32"; do
    OUT=$L timeout 60 bash bench/profile.sh nvfp4 "${p%|*}" "${p#*|}" > "$L/profile_$(echo ${p%|*} | tr ' ' _).txt" 2>&1
    echo "profile ${p%|*}: exit $? at $(el) s"
  done
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for s in "8 2 4096 14336|16,24,32,48" "128 8 2048 768|8,16,32,64"; do
    set -- ${s%|*}
    for k in auto stream wgmma ws64; do
      timeout 40 .devbin/megamoe bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens "${s#*|}" --iters 10 --gemm $k 2>&1 | sed "s/^bench:/bench[$k]:/" >> "$L/bench1.log"
    done
  done
  echo "bench1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  MEGAMOE_CLI=.devbin/megamoe timeout 90 python3 -m pytest -q -p no:cacheprovider -rs tests/py/test_multi_gpu.py \
    > "$L/multi_gpu.txt" 2>&1
  echo "multi-GPU g: $(tail -n 1 "$L/multi_gpu.txt") at $(el) s"
  for n in g main; do
    for tok in 1,8 1,8,8192; do
      timeout 60 "$(bin $n)" bench --gpus 2 --format nvfp4 --experts 256 --top-k 8 --hidden 7168 --inter 2048 \
        --tokens $tok --iters 10 2>&1 | sed "s/^bench:/bench[$n dsv3 tmax ${tok##*,}]:/" >> "$L/nccl.log"
    done
    [ $n = main ] && [ $(el) -gt 420 ] && break
    timeout 45 "$(bin $n)" bench --gpus 2 --format nvfp4 --experts 8 --top-k 2 --hidden 4096 --inter 14336 \
      --tokens 1,8,128,4096 --iters 10 2>&1 | sed "s/^bench:/bench[$n mixtral tmax 4096]:/" >> "$L/nccl.log"
  done
  left=$(( 560 - $(el) ))
  if [ $left -gt 30 ]; then
    timeout $left compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 .devbin/megamoe bench \
      --gpus 2 --format nvfp4 --experts 16 --top-k 4 --hidden 1024 --inter 512 --tokens 8,300 --iters 2 \
      > "$L/sanitize_g_ep2_memcheck.log" 2>&1
    echo "memcheck g EP2: exit $? $(grep -c 'ERROR SUMMARY' "$L/sanitize_g_ep2_memcheck.log") summaries: $(grep 'ERROR SUMMARY' "$L/sanitize_g_ep2_memcheck.log" | sort | uniq -c | tr '\n' ' ') at $(el) s"
  else echo "memcheck EP2: not run (time)"; fi
) > "$L/both.txt" 2>&1
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs
cat "$L/gpu0.txt" "$L/gpu1.txt" "$L/both.txt"
cat "$L"/profile_*.txt | grep -v "^==" | cut -c1-130
cat "$L/bench1.log" "$L/nccl.log" | grep -E "median|per layer" | sed -E 's/R=1 backend=cuda: //; s/ over 10//; s/ of touched expert weights//; s/, [0-9.]+ GB\/s.*experts\)//; s/\(slowest rank.s median\)//; s/ TFLOP.s.*//; s/backend=nccl: //' | cut -c1-110
