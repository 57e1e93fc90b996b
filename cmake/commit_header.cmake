# Writes OUT, a header defining MEGAMOE_COMMIT as COMMIT when given, else `git describe --always
# --dirty` of SRC when SRC is the top of a git work tree, else "unknown" (a source tree inside another
# repository -- an exported revision, a vendored copy -- must not take that repository's commit). Run
# at every build (see CMakeLists.txt); the file is rewritten only when the text changes, so an
# unchanged commit rebuilds nothing.
set(commit "unknown")
if(NOT "${COMMIT}" STREQUAL "")
  set(commit "${COMMIT}")
else()
  execute_process(COMMAND git -C "${SRC}" rev-parse --show-toplevel
                  OUTPUT_VARIABLE top OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
  get_filename_component(src_real "${SRC}" REALPATH)
  if(rc EQUAL 0 AND NOT top STREQUAL "")
    get_filename_component(top_real "${top}" REALPATH)
  endif()
  if(rc EQUAL 0 AND "${top_real}" STREQUAL "${src_real}")
    execute_process(COMMAND git -C "${SRC}" describe --always --dirty --abbrev=12
                    OUTPUT_VARIABLE described OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE rc)
    if(rc EQUAL 0 AND NOT described STREQUAL "")
      set(commit "${described}")
    endif()
  endif()
endif()
set(text "#define MEGAMOE_COMMIT \"${commit}\"\n")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
endif()
if(NOT "${old}" STREQUAL "${text}")
  file(WRITE "${OUT}" "${text}")
endif()
