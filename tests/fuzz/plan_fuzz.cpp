// libFuzzer target: a DDP bucket plan's text (the bucket_plan option, which
// hosts may read from files) parsed against a fixed set of parameters. A
// plan is refused with dparallel's Error or accepted; an accepted one puts
// every parameter in exactly one bucket of its dtype, and its text, written
// again, parses to the same buckets.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "core/error.h"
#include "ddp/plan_text.h"

using namespace dparallel;
using namespace dparallel::ddp;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::vector<PlanParam> params = {
      {"fc1.weight", DType::kFloat32}, {"fc1.bias", DType::kFloat32}, {"my weight", DType::kFloat16},
      {"100%", DType::kBFloat16},      {"b", DType::kFloat32},
  };
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<std::vector<size_t>> buckets;
  try {
    buckets = parse_plan(text, params, "opts->bucket_plan");
  } catch (const Error&) {
    return 0;
  }
  std::vector<int> seen(params.size(), 0);
  for (const auto& bucket : buckets) {
    if (bucket.empty()) std::abort();
    for (size_t p : bucket) {
      if (p >= params.size() || params[p].dtype != params[bucket.front()].dtype) std::abort();
      ++seen[p];
    }
  }
  for (int n : seen) {
    if (n != 1) std::abort();
  }
  if (parse_plan(format_plan(params, buckets), params, "again") != buckets) std::abort();
  return 0;
}
