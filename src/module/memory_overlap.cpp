#include "module/memory_overlap.h"

#include <algorithm>
#include <tuple>

#include "core/error.h"

namespace dparallel {

std::optional<std::pair<MemorySpan, MemorySpan>> first_overlap(std::vector<MemorySpan>& spans, bool values_too) {
  auto key = [](const MemorySpan& s) { return std::make_tuple(s.device.type, s.device.index, s.start); };
  std::sort(spans.begin(), spans.end(), [&](const MemorySpan& a, const MemorySpan& b) { return key(a) < key(b); });
  // Sorted by start, any overlap shows between neighbours.
  for (size_t k = 1; k < spans.size(); ++k) {
    const MemorySpan& a = spans[k - 1];
    const MemorySpan& b = spans[k];
    if (!(a.device == b.device) || a.start + a.nbytes <= b.start) continue;
    if (values_too || a.grad || b.grad) return std::make_pair(a, b);
  }
  return std::nullopt;
}

// Two parameters over one memory are one parameter (a tied weight); two
// that overlap only in part would have their gradients summed twice.
void check_values_apart(const std::vector<std::pair<std::string, const Parameter*>>& params) {
  std::vector<MemorySpan> spans;
  for (size_t i = 0; i < params.size(); ++i) {
    const Tensor& value = params[i].second->value();
    if (value.nbytes() > 0)
      spans.push_back({value.device(), static_cast<const char*>(value.data()), value.nbytes(), i, false});
  }
  if (auto pair = first_overlap(spans, true)) {
    const auto& a = params[pair->first.param];
    const auto& b = params[pair->second.param];
    fail_invalid("parameters '", a.first, "' (", a.second->value().describe(), ") and '", b.first, "' (",
                 b.second->value().describe(),
                 ") overlap in memory but are not the same tensor; tie a weight by registering one tensor (or "
                 "handles over the same memory, dtype and shape, which count as one parameter)");
  }
}

}  // namespace dparallel
