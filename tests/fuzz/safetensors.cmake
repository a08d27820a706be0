# The safetensors parser under libFuzzer. It builds with clang whatever the
# project's compiler is, and runs for a bounded time as a ctest test over the
# seed corpus in corpus/safetensors/ (new inputs go to a scratch folder in the build tree).
# The loader and the parts of the core it stands on (host memory only).
set(_fuzz_sources
  ${PROJECT_SOURCE_DIR}/src/module/module.cpp
  ${PROJECT_SOURCE_DIR}/src/module/safetensors.cpp
  ${PROJECT_SOURCE_DIR}/src/module/state_dict.cpp
  ${PROJECT_SOURCE_DIR}/src/module/checksum.cpp
  ${PROJECT_SOURCE_DIR}/src/core/allocator.cpp
  ${PROJECT_SOURCE_DIR}/src/core/device.cpp
  ${PROJECT_SOURCE_DIR}/src/core/device_runtime.cpp
  ${PROJECT_SOURCE_DIR}/src/core/dtype.cpp
  ${PROJECT_SOURCE_DIR}/src/core/process_origin.cpp
  ${PROJECT_SOURCE_DIR}/src/core/stream.cpp
  ${PROJECT_SOURCE_DIR}/src/core/tensor.cpp
  ${PROJECT_SOURCE_DIR}/src/core/thread_pool.cpp
  ${PROJECT_SOURCE_DIR}/src/device/cpu/cpu_kernels.cpp
  ${PROJECT_SOURCE_DIR}/src/device/cpu/cpu_runtime.cpp
  ${PROJECT_SOURCE_DIR}/src/device/cpu/cpu_streams.cpp
  ${PROJECT_SOURCE_DIR}/src/device/register_runtimes.cpp
  ${PROJECT_SOURCE_DIR}/src/device/cuda/cuda_none.cpp
  ${CMAKE_CURRENT_SOURCE_DIR}/safetensors_fuzz.cpp)
file(GLOB _fuzz_headers ${PROJECT_SOURCE_DIR}/src/module/*.h ${PROJECT_SOURCE_DIR}/src/core/*.h
     ${PROJECT_SOURCE_DIR}/src/device/cpu/*.h ${PROJECT_SOURCE_DIR}/src/device/cuda/*.h)
set(_fuzz_binary ${CMAKE_CURRENT_BINARY_DIR}/safetensors_fuzz)
add_custom_command(
  OUTPUT ${_fuzz_binary}
  COMMAND ${DP_CLANGXX} -std=c++17 -O1 -g -pthread -fsanitize=fuzzer,address,undefined
          -fno-sanitize-recover=undefined -I${PROJECT_SOURCE_DIR}/src ${_fuzz_sources} -o ${_fuzz_binary}
  DEPENDS ${_fuzz_sources} ${_fuzz_headers}
  COMMENT "Building the safetensors fuzzer with clang"
  VERBATIM)
add_custom_target(dp_safetensors_fuzz ALL DEPENDS ${_fuzz_binary})

set(_scratch ${CMAKE_CURRENT_BINARY_DIR}/scratch-corpus)
file(MAKE_DIRECTORY ${_scratch})
add_test(NAME dp_safetensors_fuzz
         COMMAND ${_fuzz_binary} -max_total_time=20 -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
                 ${_scratch} ${CMAKE_CURRENT_SOURCE_DIR}/corpus/safetensors)
set_tests_properties(dp_safetensors_fuzz PROPERTIES TIMEOUT 120)
