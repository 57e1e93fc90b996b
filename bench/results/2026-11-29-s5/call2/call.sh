#!/usr/bin/env bash
# Session 5, device call 2 (nvidia-h200-x2): wip/s5b ("la": streaming split-K by the last warp, no
# finish kernels) tested + sanitized on GPU 0, benchmarked against main and main with the item
# target at 264 on GPU 1, then the kernel crossover, the 2-GPU pytest. Logs: $OUT/logs.tar.gz.
set -u
tar xJf .devpack/devbin.tar.xz
L=$OUT/logs; mkdir -p $L
start=$(date +%s)
left() { echo $(( 545 - ($(date +%s) - start) )); }
(
  export CUDA_VISIBLE_DEVICES=0
  OUT=$L/t KERNELS="stream auto" timeout 150 bash bench/variants.sh tests la
  echo "tests done at $(( $(date +%s) - start )) s"
  OUT=$L/t timeout $(( $(left) - 100 )) bash bench/variants.sh sanitize la
  echo "sanitize done at $(( $(date +%s) - start )) s"
) > $L/gpu0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  OUT=$L/b1 TOKENS=1,8,32,128,512 timeout 240 bash bench/variants.sh bench main t264 la
  echo "b1 done at $(( $(date +%s) - start )) s"
  . bench/device_env.sh
  for g in stream wgmma; do
    for shape in "256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336"; do
      set -- $shape
      timeout 60 .devbin/megamoe_la bench --backend cuda --gemm $g --experts $1 --top-k $2 --hidden $3 --inter $4 \
        --tokens 8,16,32,64,128,256,512 --iters 10 2>&1 | sed "s/^bench:/bench[$g]:/" >> $L/crossover.log
    done
  done
  echo "crossover done at $(( $(date +%s) - start )) s"
) > $L/gpu1.txt 2>&1 &
wait
echo "left $(left) s" >> $L/gpu1.txt
if [ $(left) -gt 60 ]; then
  . bench/device_env.sh
  MEGAMOE_CLI=.devbin/megamoe_la timeout $(( $(left) - 10 )) python3 -m pytest -q -rs tests/py/test_multi_gpu.py > $L/multi_gpu.txt 2>&1
fi
tar czf $OUT/logs.tar.gz -C $OUT logs && rm -rf $L
echo "total $(( $(date +%s) - start )) s"
tar xzOf $OUT/logs.tar.gz logs/gpu0.txt logs/gpu1.txt; tail -3 $OUT/logs.tar.gz >/dev/null
