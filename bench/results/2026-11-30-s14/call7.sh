#!/usr/bin/env bash
# Prepared in session 14 for the next session (nvidia-h200-x2, carry .devpack, timeout_s 240; ~2 min
# plus the start). Builds: bench/stage_device.sh on main (a4d2197 or later; its streaming kernel is
# call 5's ldsm) and bench/pack_devbin.sh.
# Where do the streaming kernel's warps wait? Call 6's ncu had 32% of the gate/up warps' cycles on
# the long scoreboard (global / local loads) at Qwen3 T = 128, with no spills and a consumer K loop
# that reads only shared memory (CUDA_BACKEND Next 1). Here the per-instruction stall sampling of
# both phases, as SASS with its sample counts (ncu's source page, CSV), at Qwen3 T = 128 and
# Mixtral T = 32 (the two gap cells the streaming kernel runs); map the hot SASS lines back with
# cuobjdump -sass on .devbin/megamoe here.
. bench/call_lib.sh
export CUDA_VISIBLE_DEVICES=0
src_page() { # NAME "E K H I" T
  local n=$1 t=$3; set -- $2
  timeout 100 ncu --clock-control none -k "regex:sm90_expert_stream_kernel" --launch-count 2 \
    --section WarpStateStats --section SourceCounters -o "$L/rep_$n" -f \
    "${BIN:-.devbin/megamoe}" bench --backend cuda --format nvfp4 --experts $1 --top-k $2 --hidden $3 --inter $4 \
    --tokens "$t" --iters 1 > "$L/ncu_$n.txt" 2>&1
  # --print-source (sass) is in the ncu of CUDA 12.x/13.x; without it the source page defaults to SASS
  timeout 60 ncu -i "$L/rep_$n.ncu-rep" --page source --csv --print-source sass > "$L/src_$n.csv" 2>&1 ||
    timeout 60 ncu -i "$L/rep_$n.ncu-rep" --page source --csv > "$L/src_$n.csv" 2>&1
  echo "$n: $(wc -l < "$L/src_$n.csv") lines at $(el) s"
}
src_page qwen3_T128 "128 8 2048 768" 128
src_page mixtral_T32 "8 2 4096 14336" 32
call_finish
head -5 "$L/src_qwen3_T128.csv"
