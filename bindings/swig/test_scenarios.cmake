# The scenarios the Java and C# tests both run, listed once for the two.
# Each entry is "argument ranks name": DParallelTest's argument, 1 (one
# process) or 2 (a process per rank under dp-run), and the test's name after
# the language's prefix. Each language's DParallelTest implements every one;
# a scenario only one language has is added in its own CMakeLists.txt.
set(DP_SWIG_TEST_SCENARIOS
    "data-parallel 1 data_parallel_parity"
    "forward-throws 1 forward_exception_surfaces_in_caller"
    "bad-argument 1 bad_argument_raises_exception_naming_it"
    "store 1 store_round_trip_and_timeout"
    "view-outlives-tensor 1 view_outlives_its_tensor"
    "closed-handles 1 closed_handles_answer_is_closed"
    "streams 1 streams_and_host_functions"
    "ddp 2 ddp_two_process_parity"
    "collectives 2 process_group_collectives"
    "fsdp 2 fsdp_two_process_parity_and_state_dicts"
    "fsdp-views 2 fsdp_full_params_as_views_two_process_parity"
    "mesh 2 process_group_split_and_device_mesh")

# Adds <prefix>_<name> for each scenario. PROCESS: the command that runs
# one process of the test program, the argument after it; ENV: a
# `cmake -E env ...` prefix the test (or its dp-run) runs under, if any.
function(dp_add_swig_scenario_tests prefix)
  cmake_parse_arguments(S "" "" "PROCESS;ENV" ${ARGN})
  foreach(entry IN LISTS DP_SWIG_TEST_SCENARIOS)
    string(REPLACE " " ";" fields "${entry}")
    list(GET fields 0 argument)
    list(GET fields 1 ranks)
    list(GET fields 2 name)
    if(ranks EQUAL 1)
      add_test(NAME ${prefix}_${name} COMMAND ${S_ENV} ${S_PROCESS} ${argument})
    else()
      add_test(NAME ${prefix}_${name} COMMAND ${S_ENV} $<TARGET_FILE:dp-run> -n ${ranks} ${S_PROCESS} ${argument})
    endif()
  endforeach()
endfunction()
