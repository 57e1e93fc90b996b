#!/usr/bin/env bash
# Session 5, device call 4 (nvidia-h200): why the streaming kernel streams at ~2.3 TB/s (ncu stall
# reasons, scheduler issue rate, instruction mix) at DSv3 T=1 and Mixtral T=32, and the wgmma
# kernel at Mixtral T=128, for build c (wip/s5c). Logs: $OUT/logs.tar.gz.
set -u
tar xJf .devpack/devbin.tar.xz
L=$OUT/logs; mkdir -p $L
D=$OUT; export BIN=.devbin/megamoe_c OUT=$L
timeout 60 bash bench/stalls.sh sm90_expert_stream_kernel "256 8 7168 2048" 1
timeout 60 bash bench/stalls.sh sm90_expert_stream_kernel "8 2 4096 14336" 32
timeout 60 bash bench/stalls.sh sm90_expert_wgmma_kernel "8 2 4096 14336" 128
. bench/device_env.sh
timeout 90 ncu --clock-control none -k regex:sm90_expert_stream_kernel --launch-count 1 --section InstructionStats \
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --metrics smsp__inst_executed.sum,smsp__sass_inst_executed_op_shared_ld.sum,smsp__inst_executed_pipe_alu.sum,smsp__inst_executed_pipe_fma.sum,smsp__inst_executed_pipe_tensor.sum,dram__bytes_read.sum \
  $BIN bench --backend cuda --format nvfp4 --experts 256 --top-k 8 --hidden 7168 --inter 2048 --tokens 1 --iters 1 > $L/inst_dsv3_t1.txt 2>&1
grep -E "inst_executed|dram__bytes|Executed Ipc|Issue Slots|SM Busy|Mem Busy|Max Bandwidth|L1/TEX Hit|Duration" $L/inst_dsv3_t1.txt | head -30
tar czf $D/logs.tar.gz -C $D logs && rm -rf $L
