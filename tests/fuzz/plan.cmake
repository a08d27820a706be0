# The DDP bucket plan's text parser under libFuzzer, compiled by clang from
# the parser's sources only and run by ctest for a bounded time.
set(DP_PLAN_FUZZER ${CMAKE_CURRENT_BINARY_DIR}/plan_fuzz)
set(DP_PLAN_FUZZ_SOURCES
  ${CMAKE_CURRENT_SOURCE_DIR}/plan_fuzz.cpp
  ${PROJECT_SOURCE_DIR}/src/ddp/plan_text.cpp
  ${PROJECT_SOURCE_DIR}/src/core/dtype.cpp)
add_custom_command(
  OUTPUT ${DP_PLAN_FUZZER}
  COMMAND ${DP_CLANGXX} -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
          -I${PROJECT_SOURCE_DIR}/src ${DP_PLAN_FUZZ_SOURCES} -o ${DP_PLAN_FUZZER}
  DEPENDS ${DP_PLAN_FUZZ_SOURCES} ${PROJECT_SOURCE_DIR}/src/ddp/plan_text.h ${PROJECT_SOURCE_DIR}/src/core/error.h
  COMMENT "Building the bucket plan fuzzer with clang"
  VERBATIM)
# The target is not named as its output file: Ninja refuses a phony target that names itself.
add_custom_target(dp_plan_fuzzer ALL DEPENDS ${DP_PLAN_FUZZER})
# New inputs go to the build tree's corpus; the committed seeds are only read.
add_test(NAME dp_plan_fuzz
  COMMAND ${CMAKE_COMMAND} -E env ASAN_OPTIONS=detect_leaks=1
          ${DP_PLAN_FUZZER} -max_total_time=15 -timeout=5 -rss_limit_mb=1024
          ${CMAKE_CURRENT_BINARY_DIR}/plan_corpus ${CMAKE_CURRENT_SOURCE_DIR}/corpus/plan)
set_tests_properties(dp_plan_fuzz PROPERTIES TIMEOUT 60)
file(MAKE_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR}/plan_corpus)
