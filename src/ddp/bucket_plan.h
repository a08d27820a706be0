// The DDP reducer's bucket plan: which gradients are reduced together, as
// PyTorch's compute_bucket_assignment_by_size assigns them.
#pragma once

#include <cstddef>
#include <vector>

#include "core/dtype.h"

namespace dparallel::ddp {

struct PlanItem {
  DType dtype;
  size_t nbytes;
};

// Visits items[order[0]], items[order[1]], ...; each dtype fills its own open
// bucket, closed once its size reaches its cap (a dtype's first bucket has
// `first_cap`, its later ones `cap`; an item is never split). Buckets come in
// the order of their first item's position in `order`; each lists its items
// in visiting order. `order` must be a permutation of the item indices.
std::vector<std::vector<size_t>> compute_bucket_plan(const std::vector<PlanItem>& items,
                                                     const std::vector<size_t>& order, size_t first_cap, size_t cap);

}  // namespace dparallel::ddp
