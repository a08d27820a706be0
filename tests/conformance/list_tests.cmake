# Included by ctest: adds one test per typed test of DP_CONFORMANCE_TESTS
# under its gtest name, Conformance/<backend>.<scenario> (gtest_discover_tests
# renames typed tests whose types have names). DP_CONFORMANCE_KNOWN_FAILURES
# lists those that pin a behaviour the library does not have yet: they pass
# while they fail, and fail once it is fixed, to be taken off the list. The
# scenarios about what a call sends run again on the cpu backends as
# async/Conformance/... with DP_CPU_ASYNC=1 (label `async`).
execute_process(COMMAND "${DP_CONFORMANCE_TESTS}" --gtest_list_tests OUTPUT_VARIABLE listing RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  add_test(Conformance.ListsItsTests "${DP_CONFORMANCE_TESTS}" --gtest_list_tests)
  return()
endif()
string(REPLACE "\n" ";" lines "${listing}")
set(suite "")
foreach(line IN LISTS lines)
  if(line MATCHES "^([^ #][^ ]*)\\.")
    set(suite "${CMAKE_MATCH_1}")
  elseif(suite AND line MATCHES "^  ([A-Za-z0-9_]+)")
    set(name "${suite}.${CMAKE_MATCH_1}")
    add_test("${name}" "${DP_CONFORMANCE_TESTS}" "--gtest_filter=${name}")
    set_tests_properties("${name}" PROPERTIES TIMEOUT 240 SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
    list(FIND DP_CONFORMANCE_KNOWN_FAILURES "${name}" known)
    if(known GREATER -1)
      set_tests_properties("${name}" PROPERTIES WILL_FAIL TRUE)
    elseif(name MATCHES "^Conformance/(gloo|shm)\\.(EveryCollective|CallsThatDiffer|BadHandles|ThreadsTakingTurns|ForkedChild)")
      add_test("async/${name}" "${DP_CONFORMANCE_TESTS}" "--gtest_filter=${name}")
      set_tests_properties("async/${name}" PROPERTIES TIMEOUT 240 SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]"
                           LABELS async ENVIRONMENT "DP_CPU_ASYNC=1")
    endif()
  endif()
endforeach()
