#!/usr/bin/env bash
# Session 5, device call 1 (nvidia-h200-x2): tests + sanitizers on GPU 0, benchmarks on GPU 1, then
# stall sections and the 2-GPU pytest. Logs are tarred into $OUT/logs.tar.gz.
set -u
tar xJf .devpack/devbin.tar.xz
L=$OUT/logs; mkdir -p $L
start=$(date +%s)
(
  export CUDA_VISIBLE_DEVICES=0
  OUT=$L/t bash bench/variants.sh tests s5
  OUT=$L/t KERNELS="auto wgmma" bash bench/variants.sh tests n128
  OUT=$L/t KERNELS="auto stream" bash bench/variants.sh tests mid pf
  echo "tests done at $(( $(date +%s) - start )) s"
  OUT=$L/t timeout 200 bash bench/variants.sh sanitize s5
  echo "sanitize done at $(( $(date +%s) - start )) s"
) > $L/gpu0.txt 2>&1 &
(
  export CUDA_VISIBLE_DEVICES=1
  OUT=$L/b1 TOKENS=1,8,32,128,512 bash bench/variants.sh bench main s5 mid pf t132 t264 t528 b5s6
  echo "b1 done at $(( $(date +%s) - start )) s"
  OUT=$L/b2 TOKENS=2048,8192 bash bench/variants.sh bench main n128
  OUT=$L/b3 FORMATS=bf16 TOKENS=512,2048,8192 bash bench/variants.sh bench main n128
  echo "b2 b3 done at $(( $(date +%s) - start )) s"
) > $L/gpu1.txt 2>&1 &
wait
cat $L/gpu0.txt $L/gpu1.txt
left=$(( 560 - ($(date +%s) - start) ))
echo "left $left s"
if [ $left -gt 120 ]; then
  . bench/device_env.sh; MEGAMOE_CLI=.devbin/megamoe_s5 timeout 100 python3 -m pytest -q -rs tests/py/test_multi_gpu.py > $L/multi_gpu.txt 2>&1; tail -3 $L/multi_gpu.txt
fi
left=$(( 560 - ($(date +%s) - start) ))
if [ $left -gt 60 ]; then
  OUT=$L/st timeout $((left - 30)) bash bench/stalls.sh sm90_expert_stream_kernel "256 8 7168 2048" 1 > /dev/null 2>&1
fi
tar czf $OUT/logs.tar.gz -C $OUT logs && rm -rf $L
echo "total $(( $(date +%s) - start )) s"
