#!/usr/bin/env bash
# Session 7 call 3 (nvidia-h200-x2): build s7b = s7 with the ws kernel's walking form for NCCL only
# (template LOOP; one process: one block per item as on main), thread-local capture in the CLI bench.
# GPU 0: test_gpu s7b (auto ws ws64), memcheck. GPU 1: s7b against main (NVFP4 prefill), BF16
# prefill, ws64 against auto (NVFP4 Mixtral 24-64 tokens/expert, BF16 three shapes). Then both: NCCL
# EP2 decode with T_max 8 and 8192, the 2-GPU pytest (s7b).
set -u
OUT=${OUT:-device-out}
L=$OUT/logs
mkdir -p "$L"
tar xJf .devpack/devbin.tar.xz
. bench/device_env.sh
start=$(date +%s)
el() { echo $(( $(date +%s) - start )); }
shapes=("256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336")
b() { # bin tag fmt tokens gemm E K H I
  local bin=$1 tag=$2 fmt=$3 tok=$4 g=$5; shift 5
  timeout 120 "$bin" bench --backend cuda --format "$fmt" --experts $1 --top-k $2 --hidden $3 --inter $4 \
    --tokens "$tok" --iters 10 --gemm "$g" 2>&1 | sed "s/^bench:/bench[$tag $g]:/"
}
(
  export CUDA_VISIBLE_DEVICES=0
  for t in s7b:auto s7b:ws s7b:ws64; do
    n=${t%%:*} k=${t#*:} left=$(( 300 - $(el) ))
    [ $left -gt 20 ] || { echo "test_gpu $n $k: not run (time)"; continue; }
    MEGAMOE_GEMM=$k timeout $(( left < 90 ? left : 90 )) .devbin/test_gpu_$n > "$L/test_gpu_${n}_$k.log" 2>&1
    echo "test_gpu $n $k: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_${n}_$k.log" | tr '\n' ' ') at $(el) s"
  done
  for tool in memcheck; do
    left=$(( 330 - $(el) )); [ $left -gt 15 ] || { echo "$tool: not run (time)"; continue; }
    excl=(); [ $tool = racecheck ] && excl=("${RACECHECK_EXCLUDE[@]}")
    timeout $left compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 "${excl[@]}" \
      .devbin/test_gpu_s7b --quick > "$L/sanitize_s7b_$tool.log" 2>&1
    echo "$tool s7b auto: exit $? $(tail -n 1 "$L/sanitize_s7b_$tool.log") at $(el) s"
  done
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for s in "${shapes[@]}"; do
    b .devbin/megamoe main nvfp4 512,2048,8192 auto $s
    b .devbin/megamoe_s7b s7b nvfp4 512,2048,8192 auto $s
  done >> "$L/bench1.log"
  for s in "${shapes[@]}"; do b .devbin/megamoe_s7b s7b bf16 2048,8192 auto $s; done >> "$L/bench1.log"
  for g in ws64 auto; do b .devbin/megamoe_s7b s7b nvfp4 96,128,160,192,256 $g 8 2 4096 14336; done >> "$L/bench1.log"
  for s in "${shapes[@]}"; do
    for g in ws64 auto; do b .devbin/megamoe_s7b s7b bf16 128,512,1024 $g $s; done
  done >> "$L/bench1.log"
  echo "bench1 done at $(el) s"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  for tok in 1,8 1,8,8192; do
    timeout 50 .devbin/megamoe_s7b bench --gpus 2 --format nvfp4 --experts 256 --top-k 8 --hidden 7168 --inter 2048 \
      --tokens $tok --iters 10 2>&1 | sed "s/^bench:/bench[s7b nccl tmax ${tok##*,}]:/" >> "$L/nccl.log"
  done
  timeout 40 .devbin/megamoe_s7b bench --gpus 2 --format nvfp4 --experts 8 --top-k 2 --hidden 4096 --inter 14336 \
    --tokens 1,8,4096 --iters 10 2>&1 | sed "s/^bench:/bench[s7b nccl mixtral tmax 4096]:/" >> "$L/nccl.log"
  echo "nccl bench done at $(el) s"
  left=$(( 588 - $(el) ))
  if [ $left -gt 40 ]; then
    MEGAMOE_CLI=.devbin/megamoe_s7b timeout $left python3 -m pytest -q -p no:cacheprovider -rs \
      tests/py/test_multi_gpu.py > "$L/multi_gpu.txt" 2>&1
    echo "multi-GPU s7b: $(tail -n 1 "$L/multi_gpu.txt") at $(el) s"
  else echo "multi-GPU: not run (time)"; fi
) > "$L/both.txt" 2>&1

tar czf "$OUT/logs.tar.gz" -C "$OUT" logs
cat "$L/gpu0.txt" "$L/gpu1.txt" "$L/both.txt"
cat "$L/bench1.log" "$L/nccl.log" | grep -E "median|per layer" | sed -E 's/R=1 backend=cuda: //; s/ over 10//; s/ of touched expert weights//; s/, [0-9.]+ GB\/s.*experts\)//; s/\(slowest rank.s median\)//' | cut -c1-130
