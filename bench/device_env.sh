# Sourced by the GPU-machine scripts (from the repo root): the libraries staged in .devbin/libs, and
# NCCL 2.28.9 from the PyTorch wheel first on the loader path (the system copy, 2.28.3, lacks parts
# of the device API the binaries were built against).
NCCL_DIR=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null)
export LD_LIBRARY_PATH="$PWD/.devbin/libs:${NCCL_DIR:+$NCCL_DIR/lib:}${LD_LIBRARY_PATH:-}"
# The kernels compute-sanitizer's racecheck leaves out: it reports their bulk-copy / mbarrier
# hand-offs even in a minimal correct kernel (docs/TESTING.md, DECISIONS 38 and 44).
RACECHECK_EXCLUDE=(--kernel-name-exclude kns=sm90_expert_stream_kernel --kernel-name-exclude kns=sm90_expert_ws_kernel
                   --kernel-name-exclude kns=sm90_expert_ws_pp_kernel)
