// Registers every backend's device runtime with the core when the library
// loads. src/CMakeLists.txt links this object into every binary built from
// the library's objects, never as a member of an archive, so a static link
// cannot drop it and its initialiser always runs.
#include "device/cpu/cpu_runtime.h"
#include "device/cuda/cuda_runtime.h"

namespace dparallel {

namespace {

[[maybe_unused]] const bool g_registered = [] {
  cpu::register_runtime();
  cuda::register_runtime();  // registers nothing in a build without CUDA
  return true;
}();

}  // namespace

}  // namespace dparallel
