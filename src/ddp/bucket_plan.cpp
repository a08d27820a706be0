#include "ddp/bucket_plan.h"

#include <algorithm>
#include <map>

#include "core/error.h"

namespace dparallel::ddp {

std::vector<std::vector<size_t>> compute_bucket_plan(const std::vector<PlanItem>& items,
                                                     const std::vector<size_t>& order, size_t first_cap, size_t cap) {
  if (order.size() != items.size())
    fail(StatusCode::kInternal, "bucket plan: order lists ", order.size(), " of ", items.size(), " items");
  struct Open {
    std::vector<size_t> items;
    size_t bytes = 0;
    size_t closed = 0;  // buckets of this dtype closed so far
  };
  std::map<DType, Open> open;
  // (position of the first item, bucket)
  std::vector<std::pair<size_t, std::vector<size_t>>> buckets;
  std::vector<size_t> first_position(items.size(), 0);
  std::vector<bool> seen(items.size(), false);
  for (size_t pos = 0; pos < order.size(); ++pos) {
    size_t i = order[pos];
    if (i >= items.size() || seen[i]) fail(StatusCode::kInternal, "bucket plan: order is not a permutation");
    seen[i] = true;
    first_position[i] = pos;
    Open& bucket = open[items[i].dtype];
    bucket.items.push_back(i);
    bucket.bytes += items[i].nbytes;
    size_t limit = bucket.closed == 0 ? first_cap : cap;
    if (bucket.bytes >= limit) {
      buckets.emplace_back(first_position[bucket.items.front()], std::move(bucket.items));
      bucket.items.clear();
      bucket.bytes = 0;
      ++bucket.closed;
    }
  }
  for (auto& [dtype, bucket] : open) {
    if (!bucket.items.empty()) buckets.emplace_back(first_position[bucket.items.front()], std::move(bucket.items));
  }
  std::sort(buckets.begin(), buckets.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::vector<size_t>> plan;
  plan.reserve(buckets.size());
  for (auto& b : buckets) plan.push_back(std::move(b.second));
  return plan;
}

}  // namespace dparallel::ddp
