// A dp_fsdp's parameters and where their shards lie: rank r keeps rows
// [r*c, min((r+1)*c, rows)) of each (c = ceil(rows/world), torch.chunk's
// split on dim 0). This is the layout only: no process group, no job; the
// collectives over it are fsdp_collectives.h, the dp_fsdp's calls
// fully_shard.h.
//
// A rank's segment lays every sharded parameter's rows out back to back,
// each padded to c rows and starting on a cache line, so that rank r's
// segment has the same layout on every rank: the all-gather moves whole
// segments. The gradients go back through one segment per reduce dtype
// (elements, no alignment).
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "module/module.h"

namespace dparallel::fsdp {

// How torch.chunk(world) splits `rows` rows: rank r's first row and count.
struct RowSplit {
  int64_t chunk = 0;  // ceil(rows / world): the padded rows of every rank
  int64_t start = 0;
  int64_t count = 0;
};
RowSplit split_rows(int64_t rows, int32_t world, int32_t rank);

// A flat view of `t`'s rows [start, start + count), each `row_numel` elements.
Tensor rows_of(const Tensor& t, int64_t start, int64_t count, int64_t row_numel);

// What a gather of the full parameters makes.
enum class FullKind {
  // The unshard's full parameters: each in its compute dtype, and views of
  // the shard region where the layout is ShardPlacement::kFullViews.
  kCompute,
  // The values of destroy and of the state dicts: each in its own dtype,
  // always memory of their own (they outlive the shards, or are written).
  kOwn,
};

// Where this rank's shards lie; decided once, when the dp_fsdp is made.
enum class ShardPlacement {
  kPrivate,  // memory of their own: an unshard all-gathers them
  // Memory every rank maps, at the own-dtype segment's offsets: the
  // all-gather reads the other ranks' shards where they lie.
  kSegment,
  // Memory every rank maps, laid out as the full parameters: an unshard is
  // a barrier and the full parameters are views of the region.
  kFullViews,
};

// One parameter a dp_fsdp holds and this rank's shard of it.
struct ShardedParam {
  std::string name;
  std::shared_ptr<Parameter> parameter;
  DType dtype = DType::kFloat32;    // the shard's: the parameter's own
  DType compute = DType::kFloat32;  // the full parameter's while unsharded
  DType reduce = DType::kFloat32;
  Shape full_shape;
  bool sharded = true;  // false for a 0-d parameter: every rank holds it whole
  bool reduced = true;  // requires grad at create: its gradient is reduced
  int64_t row_numel = 1;
  RowSplit split;            // this rank's
  size_t reduce_offset = 0;  // elements into a rank's reduce segment of its dtype
  Tensor shard, shard_grad;

  DType full_dtype(FullKind kind) const { return kind == FullKind::kCompute ? compute : dtype; }
  // Rank `rank`'s rows of `world` ranks; a 0-d parameter is whole on each.
  RowSplit split_on(int32_t world, int32_t rank) const;
  // The elements of each rank's rows, padded to the chunk.
  size_t padded_numel() const { return static_cast<size_t>(split.chunk * row_numel); }
};

class ShardLayout {
 public:
  static constexpr size_t npos = ~size_t(0);

  // The parameters, in the order the module names them; added before plan.
  std::vector<ShardedParam>& params() { return params_; }
  const std::vector<ShardedParam>& params() const { return params_; }
  size_t size() const { return params_.size(); }
  const ShardedParam& at(size_t index) const { return params_.at(index); }
  // Which parameter (index) holds `parameter`, or npos (after plan).
  size_t index_of(const Parameter* parameter) const;

  // Each parameter's rows on `rank` of `world` and its place in its reduce
  // dtype's segment. kInvalidArgument when every rank's segment together
  // would pass 2^63 bytes.
  void plan(int32_t world, int32_t rank);
  int32_t world() const { return world_; }
  int32_t rank() const { return rank_; }
  bool any_sharded() const;

  // The all-gather segment for `kind`'s dtypes: each sharded parameter's
  // offset (bytes; 0 for the others), and the segment's size in *segment.
  std::vector<size_t> segment_offsets(FullKind kind, size_t* segment) const;
  // The full parameters back to back (own dtype, cache-line aligned): each
  // sharded parameter's offset, and the total in *total.
  std::vector<size_t> full_offsets(size_t* total) const;

  // The placement to ask for: `shared_memory` when the group makes memory
  // every rank maps, `views_asked` the host's full_params_as_views. Views
  // only when no sharded parameter is cast to another compute dtype.
  ShardPlacement wanted_placement(bool shared_memory, bool views_asked) const;
  // The bytes of this rank's part of a region for `placement`; 0 for none.
  size_t region_bytes(ShardPlacement placement) const;
  // Cuts this rank's shards out of the parameters' values, into `region`
  // as `placement` lays them out (kPrivate and no region: memory of their
  // own), and gives them their shard gradients. Fixes placement().
  void cut_shards(std::shared_ptr<Storage> region, ShardPlacement placement, const Device& device);

  ShardPlacement placement() const { return placement_; }
  // Whether an unshard hands out views of the region instead of copies.
  bool views() const { return placement_ == ShardPlacement::kFullViews; }
  // Sharded parameter `index`'s full value where it lies in the region
  // (views() only).
  Tensor full_view(size_t index) const;

  // One rank's reduce segment (elements) per reduce dtype.
  const std::map<DType, size_t>& reduce_segments() const { return reduce_segment_; }
  // The tensor the shard gradients of `dtype` are views of, laid out as its
  // reduce segment (the reduce-scatter accumulates into it), or undefined
  // where one of them has another dtype.
  Tensor shard_grad_segment(DType dtype) const;
  // Whether a post_backward has a gradient to reduce.
  bool reduces() const;
  // Copies the rows of `full` (the full shape, any dtype it casts from)
  // that this rank keeps into parameter `index`'s shard.
  void load_shard_from_full(size_t index, const Tensor& full) const;

 private:
  std::vector<ShardedParam> params_;
  std::map<const Parameter*, size_t> index_;
  int32_t world_ = 1;
  int32_t rank_ = 0;
  std::map<DType, size_t> reduce_segment_;
  std::map<DType, Tensor> shard_grad_segment_;
  ShardPlacement placement_ = ShardPlacement::kPrivate;
  std::shared_ptr<Storage> region_;  // null with kPrivate
  // With kFullViews: the region is every rank's part as one, and sharded
  // parameter i's full rows start at full_offsets_[i] (rank 0's shard first).
  std::vector<size_t> full_offsets_;
};

}  // namespace dparallel::fsdp
