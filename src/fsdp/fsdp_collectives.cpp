#include "fsdp/fsdp_collectives.h"

#include <map>
#include <memory>
#include <utility>

#include "comm/comm.h"
#include "core/device_runtime.h"
#include "distributed/backend.h"
#include "lane/float_math.h"

namespace dparallel::fsdp {

namespace {

bool is_16_bit(DType dtype) { return dtype == DType::kFloat16 || dtype == DType::kBFloat16; }

// dst += src (src of any floating dtype).
void accumulate(const Tensor& dst, const Tensor& src) {
  if (dst.numel() == 0) return;
  if (src.dtype() == dst.dtype()) {
    comm::reduce_add_into(dst, {dst, src});
    return;
  }
  Tensor cast = Tensor::empty(dst.dtype(), dst.shape(), dst.device());
  lane::cast_into(cast, src);
  comm::reduce_add_into(dst, {dst, cast});
}

Tensor bytes_of(const Tensor& t) { return t.view_at(0, DType::kUInt8, {static_cast<int64_t>(t.nbytes())}); }

// gather_full with views: the full parameters are the region itself.
std::vector<Tensor> full_from_region(const ShardLayout& layout, dist::ProcessGroup& group, FullKind kind,
                                     const std::vector<Tensor>* into) {
  // The unshard's full parameters are views of the region; the values of
  // destroy and of the state dicts outlive it, so they are copies.
  const bool as_views = kind == FullKind::kCompute;
  group.barrier(false);
  std::vector<Tensor> full(layout.size());
  for (size_t i = 0; i < layout.size(); ++i) {
    const ShardedParam& m = layout.at(i);
    const Tensor held = m.sharded ? layout.full_view(i) : m.shard;
    if (m.sharded && as_views) {
      full[i] = held;
      continue;
    }
    full[i] = into != nullptr ? (*into)[i] : Tensor::empty(m.full_dtype(kind), m.full_shape, group.device());
    lane::cast_into(full[i], held);
  }
  if (!as_views) group.barrier(false);
  return full;
}

// gather_full without views: one all-gather of every rank's segment.
std::vector<Tensor> all_gather_full(const ShardLayout& layout, dist::ProcessGroup& group, FullKind kind,
                                    const std::vector<Tensor>* into) {
  const int32_t world = group.size();
  const int32_t rank = group.rank();
  size_t segment = 0;
  const std::vector<size_t> offsets = layout.segment_offsets(kind, &segment);
  // Each rank's rows go straight into the full tensors: this rank's cast
  // from its shard, the others' from the all-gather (its runs name where
  // each rank's rows of each parameter land). The padding is never read.
  std::vector<Tensor> full(layout.size());
  std::vector<dist::SegmentRun> sources;
  std::vector<std::vector<dist::SegmentRun>> places(static_cast<size_t>(world));
  for (size_t i = 0; i < layout.size(); ++i) {
    const ShardedParam& m = layout.at(i);
    const DType dtype = m.full_dtype(kind);
    full[i] = into != nullptr ? (*into)[i] : Tensor::empty(dtype, m.full_shape, group.device());
    if (!m.sharded) {
      lane::cast_into(full[i], m.shard);
      continue;
    }
    for (int32_t r = 0; r < world; ++r) {
      const RowSplit s = m.split_on(world, r);
      if (s.count == 0) continue;
      const Tensor rows = rows_of(full[i], s.start, s.count, m.row_numel);
      if (r == rank) {
        const Tensor shard = m.shard.view({s.count * m.row_numel});
        lane::cast_into(rows, shard);
        // Sent from the shard itself where no cast is needed: in a region,
        // the other ranks read it there.
        sources.push_back(dist::SegmentRun{offsets[i], bytes_of(dtype == m.dtype ? shard : rows)});
      } else {
        places[static_cast<size_t>(r)].push_back(dist::SegmentRun{offsets[i], bytes_of(rows)});
      }
    }
  }
  if (segment > 0 && world > 1) group.all_gather_runs(segment, std::move(sources), std::move(places), false);
  return full;
}

// The job's reference to a full gradient goes once its reads are queued.
// The host may hold another and free it later on its own stream: on a
// device that queues, that free must also wait for the reads queued here.
void drop_grad(Tensor& grad, const Device& device) {
  if (grad.defined() && dist::QueuedTransfers::active()) {
    auto used = std::make_shared<Event>(device);
    used->record(device_runtime(device.type).library_stream(device.index));
    grad.storage()->record_use(std::move(used));
  }
  grad = Tensor();
}

// The reduce-scatter of the sharded parameters whose reduce dtype is
// `dtype`, whose rank segment is `segment` elements.
void reduce_scatter_dtype(const ShardLayout& layout, dist::ProcessGroup& group, DType dtype, size_t segment,
                          std::vector<Tensor>& grads, ReplicaSums* replica_sums) {
  const int32_t world = group.size();
  const Device device = group.device();
  const size_t esize = dtype_size(dtype);
  const auto seg = static_cast<int64_t>(segment);
  const std::vector<ShardedParam>& params = layout.params();
  auto member = [&](const ShardedParam& m) { return m.sharded && m.reduced && m.reduce == dtype; };
  // Straight from the full gradients when they are in the reduce dtype
  // (no cast) and need no division first (not 16-bit): each rank's part
  // is made of its rows of each gradient; padding and gradients never
  // taken count as zeros.
  bool direct = !is_16_bit(dtype);
  for (size_t i = 0; i < params.size(); ++i) {
    if (member(params[i]) && grads[i].defined() && grads[i].dtype() != dtype) direct = false;
  }
  Tensor output;
  if (direct) {
    std::vector<std::vector<dist::SegmentRun>> parts(static_cast<size_t>(world));
    for (int32_t r = 0; r < world; ++r) {
      for (size_t i = 0; i < params.size(); ++i) {
        const ShardedParam& m = params[i];
        if (!member(m) || !grads[i].defined()) continue;
        const RowSplit s = m.split_on(world, r);
        if (s.count == 0) continue;
        parts[static_cast<size_t>(r)].push_back(
            dist::SegmentRun{m.reduce_offset * esize, rows_of(grads[i], s.start, s.count, m.row_numel)});
      }
    }
    // With replicas, the shard group's average is all-reduced before it is added.
    const Tensor grads_segment = replica_sums ? Tensor() : layout.shard_grad_segment(dtype);
    if (grads_segment.defined()) {
      // Added straight into the shard gradients: no result to add below.
      group.reduce_scatter_runs(std::move(parts), grads_segment, dist::ReduceOp::kAvg, false, true);
    } else {
      output = Tensor::empty(dtype, {seg}, device);
      group.reduce_scatter_runs(std::move(parts), output, dist::ReduceOp::kAvg, false);
    }
  } else {
    // Rank r's segment holds its rows of each parameter, padded to the
    // chunk; the padding and the gradients never taken are zeros.
    Tensor input = Tensor::empty(dtype, {seg * world}, device);
    auto* bytes = static_cast<uint8_t*>(input.data());
    for (int32_t r = 0; r < world; ++r) {
      size_t written = static_cast<size_t>(r) * segment;  // elements
      for (size_t i = 0; i < params.size(); ++i) {
        const ShardedParam& m = params[i];
        if (!member(m)) continue;
        const size_t at = static_cast<size_t>(r) * segment + m.reduce_offset;
        const RowSplit s = m.split_on(world, r);
        if (at > written) fill_zero(bytes + written * esize, device, (at - written) * esize);
        written = at;
        if (s.count == 0) continue;
        const int64_t n = s.count * m.row_numel;
        if (grads[i].defined()) {
          lane::cast_into(input.view_at(at * esize, dtype, {n}), rows_of(grads[i], s.start, s.count, m.row_numel));
        } else {
          fill_zero(bytes + at * esize, device, static_cast<size_t>(n) * esize);
        }
        written = at + static_cast<size_t>(n);
      }
      const size_t end = static_cast<size_t>(r + 1) * segment;
      if (end > written) fill_zero(bytes + written * esize, device, (end - written) * esize);
    }
    // Copied in: the full gradients' memory can go now.
    for (size_t i = 0; i < params.size(); ++i) {
      if (member(params[i])) drop_grad(grads[i], device);
    }
    std::vector<Tensor> inputs;
    inputs.reserve(static_cast<size_t>(world));
    for (int32_t r = 0; r < world; ++r) {
      inputs.push_back(input.view_at(static_cast<size_t>(r) * segment * esize, dtype, {seg}));
    }
    // In place: the result lands in this rank's own segment.
    output = inputs[static_cast<size_t>(group.rank())];
    if (is_16_bit(dtype)) {
      // As the 16-bit comm hooks: divide first, so that the sum cannot overflow.
      lane::divide_tensor(input, world);
      group.reduce_scatter(inputs, output, dist::ReduceOp::kSum, false);
    } else {
      group.reduce_scatter(inputs, output, dist::ReduceOp::kAvg, false);
    }
  }
  if (replica_sums && output.defined()) replica_sums->by_dtype[dtype].buffers.push_back(output);
  for (const ShardedParam& m : params) {
    if (!output.defined() || !member(m) || m.split.count == 0) continue;
    const int64_t n = m.split.count * m.row_numel;
    const Tensor average = output.view_at(m.reduce_offset * esize, dtype, {n});
    if (replica_sums) {
      replica_sums->by_dtype[dtype].adds.emplace_back(m.shard_grad.view({n}), average);
    } else {
      accumulate(m.shard_grad.view({n}), average);
    }
  }
  for (size_t i = 0; i < params.size(); ++i) {
    if (member(params[i])) drop_grad(grads[i], device);
  }
}

}  // namespace

std::vector<Tensor> gather_full(const ShardLayout& layout, dist::ProcessGroup& group, FullKind kind,
                                const std::vector<Tensor>* into) {
  return layout.views() ? full_from_region(layout, group, kind, into) : all_gather_full(layout, group, kind, into);
}

bool gather_communicates(const ShardLayout& layout) {
  size_t segment = 0;
  layout.segment_offsets(FullKind::kOwn, &segment);
  return layout.views() || (segment > 0 && layout.world() > 1);
}

bool reduce_communicates(const ShardLayout& layout) { return layout.views() || layout.reduces(); }

void reduce_gradients(const ShardLayout& layout, dist::ProcessGroup& group, std::vector<Tensor> grads,
                      ReplicaSums* replica_sums) {
  const int32_t world = group.size();
  const Device device = group.device();
  // Sharded parameters: one reduce_scatter per reduce dtype.
  for (const auto& [dtype, segment] : layout.reduce_segments()) {
    if (segment > 0) reduce_scatter_dtype(layout, group, dtype, segment, grads, replica_sums);
  }
  // 0-d parameters: every rank holds them whole, so their gradients are all-reduced.
  std::map<DType, std::vector<size_t>> whole;
  for (size_t i = 0; i < layout.size(); ++i) {
    if (!layout.at(i).sharded && layout.at(i).reduced) whole[layout.at(i).reduce].push_back(i);
  }
  // With views, finish_backward promises that every rank has reached its
  // post_backward (its shards may be written then): with nothing to reduce,
  // a barrier says so.
  if (layout.views() && !layout.reduces()) group.barrier(false);
  for (const auto& [dtype, members] : whole) {
    std::vector<Tensor> values;
    for (size_t i : members) {
      Tensor v = Tensor::zeros(dtype, layout.at(i).full_shape, device);
      if (grads[i].defined()) lane::cast_into(v, grads[i]);
      if (is_16_bit(dtype)) lane::divide_tensor(v, world);
      values.push_back(v);
    }
    for (size_t i : members) drop_grad(grads[i], device);
    group.all_reduce_coalesced(values, is_16_bit(dtype) ? dist::ReduceOp::kSum : dist::ReduceOp::kAvg, false);
    for (size_t k = 0; k < members.size(); ++k) {
      const Tensor& target = layout.at(members[k]).shard_grad;
      if (replica_sums) {
        ReplicaSums::OfDtype& sums = replica_sums->by_dtype[dtype];
        sums.buffers.push_back(values[k]);
        sums.adds.emplace_back(target, values[k]);
      } else {
        accumulate(target, values[k]);
      }
    }
  }
  for (Tensor& grad : grads) drop_grad(grad, device);
}

void reduce_across_replicas(ReplicaSums&& sums, dist::ProcessGroup& replicas) {
  const int32_t count = replicas.size();
  const Device device = replicas.device();
  for (auto& [dtype, of_dtype] : sums.by_dtype) {
    // The shard group's averages, so the replicas' average is the average
    // over every rank of both groups (and 16-bit values were divided by the
    // shard group's size before its sum already).
    if (is_16_bit(dtype)) {
      for (const Tensor& buffer : of_dtype.buffers) lane::divide_tensor(buffer, count);
    }
    if (count > 1) {
      replicas.all_reduce_coalesced(of_dtype.buffers, is_16_bit(dtype) ? dist::ReduceOp::kSum : dist::ReduceOp::kAvg,
                                    false);
    }
    for (const auto& [target, average] : of_dtype.adds) accumulate(target, average);
    for (auto& [target, average] : of_dtype.adds) drop_grad(average, device);
    for (Tensor& buffer : of_dtype.buffers) drop_grad(buffer, device);
  }
}

}  // namespace dparallel::fsdp
