// libFuzzer target for the safetensors loader. Any input is refused with an
// Error or parsed into ranges that lie inside it; a parsed header re-encodes
// into a file that parses to the same entries; loading into a module either
// succeeds or leaves the module as it was.
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>

#include "core/error.h"
#include "module/module.h"
#include "module/safetensors.h"
#include "module/state_dict.h"

namespace st = dparallel::safetensors;
using dparallel::DType;
using dparallel::Tensor;

namespace {

const dparallel::Device kCpu{};

// fc.weight (float32 2x3), fc.bias (float32 2) and a buffer count (int64 1),
// the names the seed corpus uses; every byte set to 0x5a.
std::shared_ptr<dparallel::Module> target_module() {
  auto root = std::make_shared<dparallel::Module>();
  auto fc = std::make_shared<dparallel::Module>();
  Tensor weight = Tensor::empty(DType::kFloat32, {2, 3}, kCpu), bias = Tensor::empty(DType::kFloat32, {2}, kCpu);
  Tensor count = Tensor::empty(DType::kInt64, {1}, kCpu);
  for (const Tensor& t : {weight, bias, count}) std::memset(t.data(), 0x5a, t.nbytes());
  fc->register_parameter("weight", weight, true);
  fc->register_parameter("bias", bias, true);
  root->register_module("fc", fc);
  root->register_buffer("count", count, true);
  return root;
}

bool untouched(dparallel::Module& module) {
  for (const dparallel::StateEntry& e : dparallel::state_dict(module)) {
    const auto* bytes = static_cast<const uint8_t*>(e.value.data());
    for (size_t i = 0; i < e.value.nbytes(); ++i) {
      if (bytes[i] != 0x5a) return false;
    }
  }
  return true;
}

void check_round_trip(const uint8_t* data, size_t size, const st::Header& header) {
  std::string image = st::encode_header(header.entries, header.metadata);
  image.append(reinterpret_cast<const char*>(data) + header.data_offset, size - header.data_offset);
  st::Header again = st::parse(reinterpret_cast<const uint8_t*>(image.data()), image.size());
  if (again.entries.size() != header.entries.size() || again.metadata != header.metadata) std::abort();
  for (size_t i = 0; i < again.entries.size(); ++i) {
    const st::Entry &a = again.entries[i], &b = header.entries[i];
    if (a.name != b.name || a.dtype != b.dtype || a.shape != b.shape || a.begin != b.begin || a.end != b.end) {
      std::abort();
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    check_round_trip(data, size, st::parse(data, size));
  } catch (const dparallel::Error&) {
  }
  for (bool strict : {false, true}) {
    auto module = target_module();
    try {
      dparallel::load_module_image(*module, data, size, "fuzz input", strict);
    } catch (const dparallel::Error& e) {
      if (std::strlen(e.what()) == 0 || !untouched(*module)) std::abort();
    }
  }
  return 0;
}
