#!/bin/sh
# build_progress.sh START_FILE COMPILER ARGS...: the CUDA compiler launcher of the Python package's build
# (python/CMakeLists.txt). `pip install .` hides a build's output unless -v, and the CUDA backend takes
# minutes, so each compiled file gets a line with the time since configuration (START_FILE holds it):
# on stderr (pip -v shows it) and on the terminal, where there is one. Then it runs the compiler.
start_file=$1
shift
now=$(date +%s)
start=$(cat "$start_file" 2>/dev/null) || start=$now
case $start in '' | *[!0-9]*) start=$now ;; esac
src=
for a in "$@"; do
  case $a in *.cu | *.c | *.cpp) src=$a ;; esac
done
el=$((now - start))
line=$(printf 'megamoe build +%d:%02d: compiling %s' $((el / 60)) $((el % 60)) "$(basename "${src:-?}")")
echo "$line" >&2
{ echo "$line" >/dev/tty; } 2>/dev/null
exec "$@"
