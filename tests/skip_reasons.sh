#!/usr/bin/env bash
# Prints why tests of the last ctest run in build folder $1 skipped (ctest's summary only says
# "Skipped"), from each test's own output in Testing/Temporary/LastTest.log: a skipping test prints a
# line starting with "SKIPPED" (test_gpu, pytest -rs). One line per test and distinct reason; a test
# of which only some cases skipped is listed too.
log=${1:?usage: skip_reasons.sh BUILD_DIR}/Testing/Temporary/LastTest.log
[ -f "$log" ] || exit 0
awk '
  /^[0-9]+\/[0-9]+ Test: / { name = $3; next }
  /^SKIPPED/ && name != "" {
    r = $0
    sub(/^SKIPPED \[[0-9]+\] [^ ]*: /, "", r)  # pytest -rs: SKIPPED [n] file:line: reason
    sub(/^SKIPPED:? */, "", r)
    if (!seen[name SUBSEP r]++) print "  " name " skipped: " r
  }
' "$log"
