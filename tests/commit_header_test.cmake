# ctest's commit_header: cmake/commit_header.cmake (the commit `megamoe bench --json` records) names
# COMMIT when given, "unknown" for a source folder that is not the top of its own git work tree (an
# exported revision inside another checkout, whose commit it is not), and git's describe of a
# checkout's own top. Run with -DSCRIPT=<commit_header.cmake> -DWORK=<scratch folder>.
file(REMOVE_RECURSE "${WORK}")
file(MAKE_DIRECTORY "${WORK}/exported" "${WORK}/repo")

function(header src commit out_var)
  execute_process(COMMAND ${CMAKE_COMMAND} -DSRC=${src} -DOUT=${WORK}/h.h -DCOMMIT=${commit} -P ${SCRIPT}
                  RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "commit_header.cmake failed (${rc})")
  endif()
  file(READ "${WORK}/h.h" text)
  file(REMOVE "${WORK}/h.h")
  set(${out_var} "${text}" PARENT_SCOPE)
endfunction()

function(expect got want what)
  if(NOT got STREQUAL "#define MEGAMOE_COMMIT \"${want}\"\n")
    message(FATAL_ERROR "${what}: got '${got}', expected MEGAMOE_COMMIT \"${want}\"")
  endif()
  message(STATUS "${what}: ${want}")
endfunction()

header("${WORK}/exported" "" got)
expect("${got}" "unknown" "a folder that is not a checkout's top")
header("${WORK}/exported" "0123456789ab" got)
expect("${got}" "0123456789ab" "COMMIT given")

find_program(GIT git)
if(GIT)
  set(g ${GIT} -C ${WORK}/repo -c user.name=t -c user.email=t@example.invalid -c commit.gpgsign=false)
  execute_process(COMMAND ${g} init -q RESULT_VARIABLE rc1)
  file(WRITE "${WORK}/repo/f" "x\n")
  execute_process(COMMAND ${g} add f RESULT_VARIABLE rc2)
  execute_process(COMMAND ${g} commit -q -m c RESULT_VARIABLE rc3)
  execute_process(COMMAND ${g} rev-parse --short=12 HEAD OUTPUT_VARIABLE head OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(rc1 EQUAL 0 AND rc2 EQUAL 0 AND rc3 EQUAL 0)
    header("${WORK}/repo" "" got)
    expect("${got}" "${head}" "a checkout's own top")
  else()
    message(STATUS "a checkout's own top: not checked (git could not make a repository here)")
  endif()
else()
  message(STATUS "a checkout's own top: not checked (no git)")
endif()
file(REMOVE_RECURSE "${WORK}")
