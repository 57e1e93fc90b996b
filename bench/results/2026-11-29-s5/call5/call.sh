#!/usr/bin/env bash
# Session 5, device call 5 (nvidia-h200): the streaming consumer reading the next step's weight
# fragments a step ahead (MM_STREAM_PREFETCH_A), at 4 and 3 blocks per SM, against c (= main).
set -u
tar xJf .devpack/devbin.tar.xz
L=$OUT/logs; mkdir -p $L
start=$(date +%s)
OUT=$L/t KERNELS="stream" timeout 80 bash bench/variants.sh tests pfa
OUT=$L/b TOKENS=1,8,32,128 ITERS=10 timeout 230 bash bench/variants.sh bench c pfa pfa3 b3
echo "total $(( $(date +%s) - start )) s"
tar czf $OUT/logs.tar.gz -C $OUT logs && rm -rf $L
