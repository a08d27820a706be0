# The TCP store's message parser under libFuzzer. The main build may use gcc,
# so the fuzzer is compiled by clang directly, from the parser's sources only,
# and run by ctest for a bounded time.
set(DP_STORE_FUZZER ${CMAKE_CURRENT_BINARY_DIR}/store_fuzz)
set(DP_STORE_FUZZ_SOURCES
  ${CMAKE_CURRENT_SOURCE_DIR}/store_fuzz.cpp
  ${PROJECT_SOURCE_DIR}/src/distributed/store/tcp_protocol.cpp)
add_custom_command(
  OUTPUT ${DP_STORE_FUZZER}
  COMMAND ${DP_CLANGXX} -std=c++17 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
          -I${PROJECT_SOURCE_DIR}/src ${DP_STORE_FUZZ_SOURCES} -o ${DP_STORE_FUZZER}
  DEPENDS ${DP_STORE_FUZZ_SOURCES} ${PROJECT_SOURCE_DIR}/src/distributed/store/tcp_protocol.h
  COMMENT "Building the store fuzzer with clang"
  VERBATIM)
# The target is not named as its output file: Ninja refuses a phony target that names itself.
add_custom_target(dp_store_fuzzer ALL DEPENDS ${DP_STORE_FUZZER})
# New inputs go to the build tree's corpus; the committed seeds are only read.
add_test(NAME dp_store_fuzz
  COMMAND ${CMAKE_COMMAND} -E env ASAN_OPTIONS=detect_leaks=1
          ${DP_STORE_FUZZER} -max_total_time=20 -timeout=5 -rss_limit_mb=1024
          ${CMAKE_CURRENT_BINARY_DIR}/store_corpus ${CMAKE_CURRENT_SOURCE_DIR}/corpus/store)
set_tests_properties(dp_store_fuzz PROPERTIES TIMEOUT 60)
file(MAKE_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR}/store_corpus)
