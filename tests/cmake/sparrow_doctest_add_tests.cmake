# Registers a doctest binary's test cases with CTest, run by
# doctest_discover_tests after each link (tests/CMakeLists.txt points
# _DOCTEST_DISCOVER_TESTS_SCRIPT here).
#
# Debian's doctestAddTests.cmake starts the binary once per test case to ask
# for its suites. Every start loads LibTorch (about 0.8 s on the CI machine),
# so that cost about 340 s of a clean build for our 420 test cases. Labels
# here come from two starts per binary: every test case, then those of the
# "slow" suite (the only suite the project uses: `ctest -L slow`).
# TEST_SUITE names other than "slow" are refused below, so a new suite cannot
# silently lose its label.
cmake_policy(SET CMP0057 NEW)
set(script "")
set(tests "")

function(add_command NAME)
  set(_args "")
  foreach(_arg ${ARGN})
    if(_arg MATCHES "[^-./:a-zA-Z0-9_]")
      set(_args "${_args} [==[${_arg}]==]")
    else()
      set(_args "${_args} ${_arg}")
    endif()
  endforeach()
  set(script "${script}${NAME}(${_args})\n" PARENT_SCOPE)
endfunction()

# The test case names printed by the binary, one per list element.
function(list_cases OUT)
  execute_process(
    COMMAND ${TEST_EXECUTOR} "${TEST_EXECUTABLE}" ${ARGN}
    OUTPUT_VARIABLE output
    RESULT_VARIABLE result
    WORKING_DIRECTORY "${TEST_WORKING_DIR}")
  if(NOT result EQUAL 0)
    message(FATAL_ERROR "Error running test executable '${TEST_EXECUTABLE}' ${ARGN}:\n  Result: ${result}\n  Output: ${output}\n")
  endif()
  string(REPLACE "\n" ";" output "${output}")
  set(names "")
  foreach(line ${output})
    if(line STREQUAL "===============================================================================" OR line MATCHES [==[^\[doctest\] ]==])
      continue()
    endif()
    list(APPEND names "${line}")
  endforeach()
  set(${OUT} "${names}" PARENT_SCOPE)
endfunction()

if(NOT EXISTS "${TEST_EXECUTABLE}")
  message(FATAL_ERROR "Specified test executable '${TEST_EXECUTABLE}' does not exist")
endif()

list_cases(all --list-test-cases)
list_cases(suites --list-test-suites)
foreach(suite IN LISTS suites)
  if(NOT suite STREQUAL "slow")
    message(FATAL_ERROR "${TEST_EXECUTABLE}: TEST_SUITE(\"${suite}\") is not a label this script knows (only \"slow\")")
  endif()
endforeach()
set(slow "")
if(suites)
  list_cases(slow --list-test-cases --test-suite=slow)
endif()

foreach(test IN LISTS all)
  set(labels "")
  if(test IN_LIST slow)
    set(labels slow)
  endif()
  # doctest splits --test-case at ','; escape it.
  string(REPLACE "," "\\," test_filter "${test}")
  add_command(add_test "${test}" ${TEST_EXECUTOR} "${TEST_EXECUTABLE}" "--test-case=${test_filter}" ${TEST_EXTRA_ARGS})
  add_command(set_tests_properties "${test}" PROPERTIES WORKING_DIRECTORY "${TEST_WORKING_DIR}" ${TEST_PROPERTIES}
              LABELS ${labels})
  list(APPEND tests "${test}")
endforeach()
add_command(set ${TEST_LIST} ${tests})
file(WRITE "${CTEST_FILE}" "${script}")
