# Sourced by the GPU-machine scripts (from the repo root): the libraries staged in .devbin/libs, and
# NCCL 2.28.9 from the PyTorch wheel first on the loader path (the system copy, 2.28.3, lacks parts
# of the device API the binaries were built against).
# The binaries come packed (bench/device/stage.sh): unpack .devbin/bins.tar.xz once per staging, with
# xz, or with Python's lzma where xz is missing.
if [ -f .devbin/bins.tar.xz ] && { [ ! -f .devbin/.unpacked ] || [ .devbin/bins.tar.xz -nt .devbin/.unpacked ]; }; then
  if command -v xz >/dev/null; then
    xz -dc .devbin/bins.tar.xz | tar -xf - -C .devbin
  else
    python3 -c 'import sys, tarfile; t = tarfile.open(sys.argv[1]); t.extractall(sys.argv[2], **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))' .devbin/bins.tar.xz .devbin
  fi && touch .devbin/.unpacked
fi
NCCL_DIR=$(python3 -c 'import nvidia.nccl as n; print(list(n.__path__)[0])' 2>/dev/null || true)
export LD_LIBRARY_PATH="$PWD/.devbin/libs:${NCCL_DIR:+$NCCL_DIR/lib:}${LD_LIBRARY_PATH:-}"
# The GEMM kernel modes test_gpu runs in (MEGAMOE_GEMM=...): chosen per forward, then each forced.
KERNEL_MODES=${KERNEL_MODES:-auto mma wgmma stream ws ws64}
# The kernels compute-sanitizer's racecheck leaves out: it reports their bulk-copy / mbarrier
# hand-offs even in a minimal correct kernel (dev/sm90_racecheck_probe.cu, docs/TESTING.md). Name
# substrings: expert_ws covers the warp-specialized kernel and its ping-pong form.
RACECHECK_EXCLUDE=(--kernel-name-exclude kns=expert_stream --kernel-name-exclude kns=expert_ws)
# The three shapes of the benchmark table (E K H I): DeepSeek-V3-like, Qwen3-30B-like, Mixtral-like.
SHAPES3=("256 8 7168 2048" "128 8 2048 768" "8 2 4096 14336")
