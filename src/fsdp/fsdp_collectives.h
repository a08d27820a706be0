// The collectives of a dp_fsdp, as functions of its shard layout
// (sharded_param.h) and its group. Each runs inside one of the dp_fsdp's
// jobs on the group's comm lane, and every rank makes the same calls.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "distributed/process_group.h"
#include "fsdp/sharded_param.h"

namespace dparallel::fsdp {

// Every parameter's full value as `kind` asks (dtype, views). One
// all-gather of every rank's segment: each rank's rows go straight into
// the full tensors, the padding is never read. With the layout's views
// (ShardPlacement::kFullViews) no data moves: a barrier (every rank's
// shards are written), then views of the region for kCompute, or copies
// for kOwn, after which a second barrier keeps every rank's shards as they
// are until all have copied.
std::vector<Tensor> gather_full(const ShardLayout& layout, dist::ProcessGroup& group, FullKind kind);

// Whether gather_full makes a collective: a refusal then stands in for it.
bool gather_communicates(const ShardLayout& layout);

// post_backward's reduction of `grads` (the full gradients, by parameter
// index; undefined where never taken, which count as zeros): one
// reduce-scatter per reduce dtype of the sharded parameters' gradients,
// averaged and added into their shard gradients, and one all-reduce per
// reduce dtype of the 0-d parameters'. Each full gradient is let go of
// once its reads are queued.
void reduce_gradients(const ShardLayout& layout, dist::ProcessGroup& group, std::vector<Tensor> grads);

// Whether reduce_gradients makes a collective: with views, a barrier even
// with nothing to reduce.
bool reduce_communicates(const ShardLayout& layout);

}  // namespace dparallel::fsdp
