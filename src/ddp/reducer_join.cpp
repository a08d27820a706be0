// dp_ddp_join: a joined rank's stand-ins for the other ranks' jobs, and the
// state every rank takes once all joined.
#include "core/error.h"
#include "ddp/reducer.h"
#include "ddp/reducer_internal.h"
#include "lane/host_values.h"

namespace dparallel::ddp {

using detail::fail_broken;
using dist::CallItem;

void Reducer::run_shadow(const lane::JobSpec& spec) {
  switch (spec.item) {
    case CallItem::kBucket: {
      if (spec.index >= buckets_.size()) {
        fail(StatusCode::kState, "dp_ddp_join: another rank reduces bucket ", spec.index, " but this rank has ",
             buckets_.size(), " buckets");
      }
      if (debug_ == lane::DebugLevel::kDetail) check_fingerprint(spec.index);
      if (defers(spec.index)) return;
      if (defer_) return reduce_deferred(true);
      return reduce_zeros(spec.index);
    }
    case CallItem::kUsedMap:
      run_used_map();  // this rank used nothing since its last synced backward
      return;
    case CallItem::kReadyOrder: {
      run_ready_order();
      // The other ranks rebuild from it at their finish: the same plan here.
      std::lock_guard<std::mutex> lock(mutex_);
      std::vector<size_t> order = std::move(rank0_order_);
      rebuild(order, std::move(next_region_));
      return;
    }
    case CallItem::kBuffers:
      broadcast_state(buffers_);
      return;
    default:
      fail(StatusCode::kState, "dp_ddp_join: another rank runs ", dist::call_item_name(spec.item, 0),
           ", which a joined rank cannot stand in for (make every rank create its dp_ddp before any joins)");
  }
}

void Reducer::join(const std::vector<std::shared_ptr<Reducer>>& reducers) {
  if (reducers.empty()) return;
  std::shared_ptr<lane::CommLane> shared_lane = reducers.front()->lane_;
  for (const auto& r : reducers) {
    std::lock_guard<std::mutex> lock(r->mutex_);
    if (r->retired_) detail::fail_retired();
    if (r->broken_) fail_broken();
    if (r->finishing_ || r->any_mark_) {
      fail(StatusCode::kState,
           "dp_ddp_join: a backward of a dp_ddp passed is in progress; join after its "
           "dp_ddp_finish_backward");
    }
    if (r->lane_ != shared_lane) fail_invalid("argument 'ddps': the dp_ddp are on different process groups");
  }
  shared_lane->join(std::vector<std::shared_ptr<lane::LaneOwner>>(reducers.begin(), reducers.end()),
                    reducers.front()->lane_bound());
  for (const auto& r : reducers) {
    r->on_lane(CallItem::kJoinSync, [&] { r->sync_after_join(); });
  }
}

void Reducer::sync_after_join() {
  uint32_t mine = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    mine = iteration_;
  }
  const int32_t world = group_->size();
  const Device device = group_->device();
  std::vector<Tensor> all = lane::gather_outputs(world, DType::kInt64, 1, device);
  group_->all_gather(lane::to_device(lane::host_int64({static_cast<int64_t>(mine)}), device), all, false);
  int32_t root = 0;
  int64_t most = -1;
  for (int32_t r = 0; r < world; ++r) {
    int64_t n = lane::read_int64(all[static_cast<size_t>(r)]).at(0);
    if (n >= most) {
      most = n;
      root = r;
    }
  }
  broadcast_state(sync_state_, root);
  // static_graph may have been recorded while this rank stood in: every
  // rank takes the root's record, so their later iterations run alike.
  Tensor graph = Tensor::zeros(DType::kUInt8, {static_cast<int64_t>(params_.size() + 1)}, lane::kHostDevice);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto* bytes = static_cast<uint8_t*>(graph.data());
    bytes[0] = graph_recorded_ ? 1 : 0;
    for (size_t i = 0; i < static_used_.size() && i < params_.size(); ++i) bytes[i + 1] = static_used_[i];
  }
  Tensor on_device = lane::to_device(graph, device);
  group_->broadcast(on_device, root, false);
  Tensor back = lane::to_device(on_device, lane::kHostDevice);
  const auto* bytes = static_cast<const uint8_t*>(back.data());
  std::lock_guard<std::mutex> lock(mutex_);
  graph_recorded_ = bytes[0] != 0;
  static_used_.assign(bytes + 1, bytes + 1 + params_.size());
  if (!graph_recorded_) static_used_.clear();
  iteration_ = static_cast<uint32_t>(most);
  active_ranks_.store(0);
}

}  // namespace dparallel::ddp
