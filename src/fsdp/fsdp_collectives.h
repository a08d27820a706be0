// The collectives of a dp_fsdp, as functions of its shard layout
// (sharded_param.h) and its group. Each runs inside one of the dp_fsdp's
// jobs on the group's comm lane, and every rank makes the same calls.
#pragma once

#include <cstdint>
#include <map>
#include <utility>
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
// are until all have copied. With `into` (kCompute: the full parameters at
// their fixed addresses, backed), the values land there and those tensors
// are returned, views of the region where the layout has them.
std::vector<Tensor> gather_full(const ShardLayout& layout, dist::ProcessGroup& group, FullKind kind,
                                const std::vector<Tensor>* into = nullptr);

// Whether gather_full makes a collective: a refusal then stands in for it.
bool gather_communicates(const ShardLayout& layout);

// HSDP: the shard group's averages of this rank's gradient rows, per
// reduce dtype, before they are added into the shard gradients: `buffers`
// to all-reduce across the replicas, then each (shard gradient, view of a
// buffer) pair in `adds` to add.
struct ReplicaSums {
  struct OfDtype {
    std::vector<Tensor> buffers;
    std::vector<std::pair<Tensor, Tensor>> adds;
  };
  std::map<DType, OfDtype> by_dtype;
  bool empty() const { return by_dtype.empty(); }
};

// post_backward's reduction of `grads` (the full gradients, by parameter
// index; undefined where never taken, which count as zeros): one
// reduce-scatter per reduce dtype of the sharded parameters' gradients,
// averaged and added into their shard gradients, and one all-reduce per
// reduce dtype of the 0-d parameters'. Each full gradient is let go of
// once its reads are queued. With `replica_sums` (HSDP), the averages are
// left there instead of added into the shard gradients.
void reduce_gradients(const ShardLayout& layout, dist::ProcessGroup& group, std::vector<Tensor> grads,
                      ReplicaSums* replica_sums = nullptr);

// HSDP: `sums` all-reduced across `replicas` (one all-reduce per dtype,
// averaged over its ranks; 16-bit dtypes divided first, as in the shard
// group, so that the sum cannot overflow), then added into the shard
// gradients. The replicas' layouts agree (checked at creation), so their
// buffers pair.
void reduce_across_replicas(ReplicaSums&& sums, dist::ProcessGroup& replicas);

// Whether reduce_gradients makes a collective: with views, a barrier even
// with nothing to reduce.
bool reduce_communicates(const ShardLayout& layout);

}  // namespace dparallel::fsdp
