#!/usr/bin/env bash
# Session 5, device call 3 (nvidia-h200-x2): wip/s5c ("c" = main + occupier test + NCCL fixes +
# streaming split-K by the last warp + wgmma split-K) tested and sanitized on GPU 0; on GPU 1 the
# whole NVFP4 table main vs c, the wgmma split at Mixtral T = 32..512, per-kernel ncu times; then
# the 2-GPU pytest and EP2 bench. Logs: $OUT/logs.tar.gz.
set -u
tar xJf .devpack/devbin.tar.xz
L=$OUT/logs; mkdir -p $L
start=$(date +%s)
left() { echo $(( 470 - ($(date +%s) - start) )); }
(
  export CUDA_VISIBLE_DEVICES=0
  OUT=$L/t KERNELS="auto wgmma stream" timeout 200 bash bench/variants.sh tests c
  echo "tests done at $(( $(date +%s) - start )) s"
  OUT=$L/t timeout 120 bash bench/variants.sh sanitize c
  echo "sanitize done at $(( $(date +%s) - start )) s"
  . bench/device_env.sh
  for shape in "8 2 4096 14336" "128 8 2048 768"; do
    set -- $shape
    for g in wgmma stream; do
      timeout 40 .devbin/megamoe_c bench --backend cuda --gemm $g --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 32,64,128,256,512 --iters 10 2>&1 | sed "s/^bench:/bench[c-$g]:/" >> $L/crossover.log
    done
  done
  echo "crossover done at $(( $(date +%s) - start )) s"
) > $L/gpu0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  OUT=$L/b1 timeout 260 bash bench/variants.sh bench main la c
  echo "b1 done at $(( $(date +%s) - start )) s"
  for p in "128 8 2048 768|1,128" "8 2 4096 14336|32,128" "256 8 7168 2048|1"; do
    OUT=$L/ncu BIN=.devbin/megamoe_c timeout 40 bash bench/profile.sh nvfp4 "${p%%|*}" "${p##*|}"
  done
  echo "ncu done at $(( $(date +%s) - start )) s"
) > $L/gpu1.txt 2>&1 &
wait
echo "left $(left) s" >> $L/gpu1.txt
. bench/device_env.sh
if [ $(left) -gt 50 ]; then
  MEGAMOE_CLI=.devbin/megamoe_c timeout 60 python3 -m pytest -q -rs tests/py/test_multi_gpu.py > $L/multi_gpu.txt 2>&1
fi
if [ $(left) -gt 30 ]; then
  timeout $(( $(left) - 5 )) .devbin/megamoe_c bench --backend cuda --gpus 2 --experts 256 --top-k 8 --hidden 7168 --inter 2048 \
    --tokens 1,8,32,128 --iters 10 > $L/ep2.log 2>&1
fi
tar czf $OUT/logs.tar.gz -C $OUT logs && rm -rf $L
echo "total $(( $(date +%s) - start )) s"
tar xzOf $OUT/logs.tar.gz logs/gpu0.txt logs/gpu1.txt
