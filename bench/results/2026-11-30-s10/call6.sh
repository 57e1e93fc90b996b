#!/usr/bin/env bash
# Session 10 call 6 (nvidia-h200-x2): wip/stream-early-w (main 84b82b1 + the producer issuing its
# first steps' weights before the token lookups). Builds (here): bash bench/stage_device.sh;
# bash bench/build_variants.sh "old@main="; bash bench/pack_devbin.sh.
# GPU 0: test_gpu stream / auto, memcheck stream. GPU 1: old / new alternating twice at the
# streaming cells. Both: the 2-GPU pytest (bitwise one GPU = two GPUs).
# The steps are call5.sh's, word for word (the builds differ): it ran them.
exec bash "$(dirname "$0")/call5.sh"
