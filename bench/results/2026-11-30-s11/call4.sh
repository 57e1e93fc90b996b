#!/usr/bin/env bash
# Session 11, call 4 (nvidia-h200-x2): the whole suite and both tables on main 7bb2f4d (session 10's
# stream-chain, the 5-blocks-per-SM streaming instantiation, the compact streaming epilogues).
# Builds (here): bash bench/stage_device.sh; bash bench/pack_devbin.sh.
# The steps it ran are bench/full_suite.sh's (written out here then; the table's shapes ran in the
# order DeepSeek-V3, Qwen3, Mixtral, full_suite.sh's order is Qwen3, Mixtral, DeepSeek-V3).
exec bash bench/full_suite.sh
