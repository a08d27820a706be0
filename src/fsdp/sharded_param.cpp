#include "fsdp/sharded_param.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <utility>

#include "core/error.h"
#include "ddp/comm_hooks.h"

namespace dparallel::fsdp {

namespace {

// Each parameter's rows start on a cache line of a segment.
constexpr size_t kSegmentAlign = 64;
size_t align_up(size_t n) { return (n + kSegmentAlign - 1) / kSegmentAlign * kSegmentAlign; }

// Each sharded parameter's offset (bytes) when each takes bytes_of(it),
// starting on a cache line, and the total.
std::vector<size_t> sharded_offsets(const std::vector<ShardedParam>& params,
                                    const std::function<size_t(const ShardedParam&)>& bytes_of, size_t* total) {
  std::vector<size_t> offsets(params.size(), 0);
  size_t at = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const ShardedParam& m = params[i];
    if (!m.sharded) continue;
    offsets[i] = at;
    at = align_up(at + bytes_of(m));
  }
  *total = at;
  return offsets;
}

}  // namespace

RowSplit split_rows(int64_t rows, int32_t world, int32_t rank) {
  RowSplit s;
  s.chunk = rows == 0 ? 0 : (rows + world - 1) / world;
  s.start = std::min(rows, s.chunk * rank);
  s.count = std::max<int64_t>(0, std::min(rows, s.start + s.chunk) - s.start);
  return s;
}

Tensor rows_of(const Tensor& t, int64_t start, int64_t count, int64_t row_numel) {
  return t.view_at(static_cast<size_t>(start * row_numel) * t.element_size(), t.dtype(), {count * row_numel});
}

RowSplit ShardedParam::split_on(int32_t world, int32_t rank) const {
  return sharded ? split_rows(full_shape[0], world, rank) : RowSplit{1, 0, 1};
}

size_t ShardLayout::index_of(const Parameter* parameter) const {
  auto it = index_.find(parameter);
  return it == index_.end() ? npos : it->second;
}

void ShardLayout::plan(int32_t world, int32_t rank) {
  world_ = world;
  rank_ = rank;
  size_t segment = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    ShardedParam& m = params_[i];
    index_[m.parameter.get()] = i;
    if (!m.sharded) {
      m.split = RowSplit{1, 0, 1};
      continue;
    }
    m.row_numel = 1;
    for (size_t d = 1; d < m.full_shape.size(); ++d) m.row_numel *= m.full_shape[d];
    m.split = split_rows(m.full_shape[0], world, rank);
    const size_t padded = m.padded_numel();
    // The widest of the two segments (compute or own dtype); each rank's
    // padded rows are at most the parameter's own size.
    segment = align_up(segment + padded * std::max(dtype_size(m.compute), dtype_size(m.dtype)));
    if (!m.reduced) continue;
    m.reduce_offset = reduce_segment_[m.reduce];
    reduce_segment_[m.reduce] += padded;
  }
  if (segment > std::numeric_limits<size_t>::max() / static_cast<size_t>(world) ||
      segment * static_cast<size_t>(world) > static_cast<size_t>(std::numeric_limits<int64_t>::max())) {
    fail_invalid("argument 'module': the unsharded parameters of ", world, " ranks would take more than 2^63 bytes");
  }
}

bool ShardLayout::any_sharded() const {
  return std::any_of(params_.begin(), params_.end(), [](const ShardedParam& m) { return m.sharded; });
}

std::vector<size_t> ShardLayout::segment_offsets(FullKind kind, size_t* segment) const {
  return sharded_offsets(
      params_, [&](const ShardedParam& m) { return m.padded_numel() * dtype_size(m.full_dtype(kind)); }, segment);
}

std::vector<size_t> ShardLayout::full_offsets(size_t* total) const {
  return sharded_offsets(
      params_,
      [](const ShardedParam& m) { return static_cast<size_t>(m.full_shape[0] * m.row_numel) * dtype_size(m.dtype); },
      total);
}

ShardPlacement ShardLayout::wanted_placement(bool shared_memory, bool views_asked) const {
  if (!shared_memory || !any_sharded()) return ShardPlacement::kPrivate;
  // A view is the shard's own memory: no cast to a compute dtype on the way.
  const bool no_cast = std::all_of(params_.begin(), params_.end(),
                                   [](const ShardedParam& m) { return !m.sharded || m.compute == m.dtype; });
  return views_asked && no_cast ? ShardPlacement::kFullViews : ShardPlacement::kSegment;
}

size_t ShardLayout::region_bytes(ShardPlacement placement) const {
  size_t bytes = 0;
  switch (placement) {
    case ShardPlacement::kPrivate:
      return 0;
    case ShardPlacement::kSegment:
      segment_offsets(FullKind::kOwn, &bytes);
      return bytes;
    case ShardPlacement::kFullViews: {
      full_offsets(&bytes);
      const auto world = static_cast<size_t>(world_);
      return (bytes + world - 1) / world;
    }
  }
  return 0;
}

void ShardLayout::cut_shards(std::shared_ptr<Storage> region, ShardPlacement placement, const Device& device) {
  placement_ = region ? placement : ShardPlacement::kPrivate;
  region_ = placement_ == ShardPlacement::kPrivate ? nullptr : std::move(region);
  size_t bytes = 0;
  std::vector<size_t> offsets;
  if (placement_ == ShardPlacement::kSegment) offsets = segment_offsets(FullKind::kOwn, &bytes);
  if (placement_ == ShardPlacement::kFullViews) offsets = full_offsets_ = full_offsets(&bytes);
  for (const auto& [dtype, segment] : reduce_segment_) {
    const bool same_dtype = std::all_of(params_.begin(), params_.end(), [&, dtype = dtype](const ShardedParam& m) {
      return !(m.sharded && m.reduced && m.reduce == dtype) || m.dtype == dtype;
    });
    if (same_dtype) shard_grad_segment_[dtype] = Tensor::zeros(dtype, {static_cast<int64_t>(segment)}, device);
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    ShardedParam& m = params_[i];
    const Tensor full = m.parameter->value();
    Shape shape = m.full_shape;
    if (m.sharded) shape[0] = m.split.count;
    // Its own memory: the full parameter's goes back to the allocator. An
    // empty shard is never wrapped in the region, where it could share its
    // identity with another empty shard (tied parameters).
    const bool in_region = region_ != nullptr && m.sharded && m.split.count > 0;
    if (in_region && placement_ == ShardPlacement::kFullViews) {
      const size_t rows_before = static_cast<size_t>(m.split.start * m.row_numel) * dtype_size(m.dtype);
      m.shard = Tensor::wrap(region_, offsets[i] + rows_before, m.dtype, shape);
    } else if (in_region) {
      m.shard = Tensor::wrap(region_, offsets[i], m.dtype, shape);
    } else {
      m.shard = Tensor::empty(m.dtype, shape, device);
    }
    if (!m.sharded) {
      copy_tensor(m.shard, full);
    } else if (m.split.count > 0) {
      copy_tensor(m.shard, full.narrow_rows(m.split.start, m.split.count));
    }
    auto segment = shard_grad_segment_.find(m.reduce);
    if (m.sharded && m.reduced && segment != shard_grad_segment_.end()) {
      m.shard_grad = segment->second.view_at(m.reduce_offset * dtype_size(m.dtype), m.dtype, shape);
    } else {
      m.shard_grad = Tensor::zeros(m.dtype, shape, device);
    }
  }
}

Tensor ShardLayout::full_view(size_t index) const {
  const ShardedParam& m = params_.at(index);
  return Tensor::wrap(region_, full_offsets_.at(index), m.dtype, m.full_shape);
}

Tensor ShardLayout::shard_grad_segment(DType dtype) const {
  auto it = shard_grad_segment_.find(dtype);
  return it == shard_grad_segment_.end() ? Tensor() : it->second;
}

bool ShardLayout::reduces() const {
  return std::any_of(params_.begin(), params_.end(), [](const ShardedParam& m) { return !m.sharded && m.reduced; }) ||
         std::any_of(reduce_segment_.begin(), reduce_segment_.end(),
                     [](const auto& entry) { return entry.second > 0; });
}

void ShardLayout::load_shard_from_full(size_t index, const Tensor& full) const {
  const ShardedParam& m = params_.at(index);
  if (!m.sharded) {
    ddp::cast_into(m.shard, full);
    return;
  }
  if (m.split.count == 0) return;
  ddp::cast_into(m.shard.view({m.split.count * m.row_numel}), rows_of(full, m.split.start, m.split.count, m.row_numel));
}

}  // namespace dparallel::fsdp
