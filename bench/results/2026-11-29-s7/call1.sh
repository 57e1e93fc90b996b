#!/usr/bin/env bash
# Session 7 call 1 (nvidia-h200-x2): the four variants prepared in session 6, all first runs.
# GPU 0: the BF16 gather probe, test_gpu of each variant with its kernel forced (pers ws, bss ws,
# ws64 ws64, noinc ws), then ws64 against main at T = 32..512. GPU 1: NVFP4 prefill main / pers /
# noinc, BF16 prefill main / bss. Then both GPUs: NCCL EP2 decode with T_max = T against T_max 8192
# (main and pers), and the 2-GPU pytest on main. Logs tarred in $OUT/logs.tar.gz.
set -u
OUT=${OUT:-device-out}
L=$OUT/logs
mkdir -p "$L"
tar xJf .devpack/devbin.tar.xz
. bench/device_env.sh
start=$(date +%s)
at() { echo "at $(( $(date +%s) - start )) s"; }
shapes=("256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336")
b() { # build tag fmt tokens gemm shape...
  local bin=$1 tag=$2 fmt=$3 tok=$4 g=$5; shift 5
  timeout 120 "$bin" bench --backend cuda --format "$fmt" --experts $1 --top-k $2 --hidden $3 --inter $4 \
    --tokens "$tok" --iters 10 --gemm "$g" 2>&1 | sed "s/^bench:/bench[$tag]:/"
}
(
  export CUDA_VISIBLE_DEVICES=0
  echo "== probe"; timeout 60 .devbin/sm90_bf16_gather_probe 2>&1 | tail -n 12; at
  for t in pers:ws bss:ws ws64:ws64 noinc:ws; do
    n=${t%%:*} k=${t#*:}
    MEGAMOE_GEMM=$k timeout 90 .devbin/test_gpu_$n > "$L/test_gpu_${n}_$k.log" 2>&1
    echo "test_gpu $n $k: exit $? $(grep -E '^\[  (PASSED|FAILED)' "$L/test_gpu_${n}_$k.log" | tr '\n' ' ') $(at)"
  done
  for s in "${shapes[@]}"; do
    b .devbin/megamoe main nvfp4 32,128,512 auto $s >> "$L/bench0.log"
    b .devbin/megamoe_ws64 ws64 nvfp4 32,128,512 ws64 $s >> "$L/bench0.log"
  done
  echo "bench0 done $(at)"
) > "$L/gpu0.txt" 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  for s in "${shapes[@]}"; do
    for n in main pers noinc; do
      bin=.devbin/megamoe_$n; [ $n = main ] && bin=.devbin/megamoe
      b $bin $n nvfp4 512,2048,8192 auto $s >> "$L/bench1.log"
    done
  done
  echo "nvfp4 done $(at)"
  for s in "${shapes[@]}"; do
    b .devbin/megamoe main bf16 2048,8192 auto $s >> "$L/bench1.log"
    b .devbin/megamoe_bss bss bf16 2048,8192 auto $s >> "$L/bench1.log"
  done
  echo "bench1 done $(at)"
) > "$L/gpu1.txt" 2>&1 &
wait
(
  for n in main pers; do
    bin=.devbin/megamoe_$n; [ $n = main ] && bin=.devbin/megamoe
    for tok in 1,8 1,8,8192; do
      timeout 60 $bin bench --gpus 2 --format nvfp4 --experts 256 --top-k 8 --hidden 7168 --inter 2048 \
        --tokens $tok --iters 10 2>&1 | sed "s/^bench:/bench[$n tmax ${tok##*,}]:/" >> "$L/nccl.log"
    done
  done
  echo "nccl bench done $(at)"
  left=$(( 560 - ($(date +%s) - start) ))
  if [ $left -gt 50 ]; then
    MEGAMOE_CLI=.devbin/megamoe timeout $left python3 -m pytest -q -p no:cacheprovider -rs \
      tests/py/test_multi_gpu.py > "$L/multi_gpu.txt" 2>&1
    echo "multi-GPU: $(tail -n 1 "$L/multi_gpu.txt") $(at)"
  fi
) > "$L/both.txt" 2>&1
tar czf "$OUT/logs.tar.gz" -C "$OUT" logs
cat "$L/gpu0.txt" "$L/gpu1.txt" "$L/both.txt"
cat "$L"/bench*.log "$L/nccl.log" | grep median | sed -E 's/R=1 backend=cuda: //; s/ over 10//; s/ of touched expert weights//; s/, [0-9.]+ GB\/s.*experts\)//' | cut -c1-140
