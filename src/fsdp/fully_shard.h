// fully_shard (PyTorch's FSDP2) over a module's parameters: each rank keeps
// rows [r*c, min((r+1)*c, rows)) of every parameter (c = ceil(rows/world),
// torch.chunk's split on dim 0); unshard all-gathers them into full
// parameters, post_backward reduce-scatters the full gradients into the
// shards' gradients. Every collective is a job on the group's comm lane
// (ddp/comm_lane.h), so dp_ddp and several dp_fsdp on one group pair their
// calls by identity whatever order the host issues them in.
//
// One all-gather per unshard: every sharded parameter's rows, cast to the
// compute dtype, lie in one flat byte buffer per rank (a segment), each
// padded to c rows, so that rank r's segment is the same layout on every
// rank. The gradients go the same way back, one reduce-scatter per reduce
// dtype. A 0-d parameter is not sharded: every rank holds it whole and its
// gradient is all-reduced.
//
// With full_params_as_views on a shared-memory group, the shards are laid
// out as the full parameters instead, in memory every rank maps: an unshard
// is a barrier and the full parameters are views (dp_fsdp.h has the host's
// side of that).
//
// The host drives one dp_fsdp from one thread at a time; calls from several
// threads are serialised.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/stream.h"
#include "core/tensor.h"
#include "distributed/process_group.h"
#include "lane/comm_lane.h"
#include "module/module.h"

namespace dparallel::fsdp {

struct ShardingOptions {
  bool reshard_after_forward = true;
  std::optional<DType> param_dtype;   // the dtype the host computes in; unset: each parameter's own
  std::optional<DType> reduce_dtype;  // unset: the compute dtype
  bool init_sync = true;              // rank 0's values and an agreement check before sharding
  // Where the shards can lie in memory every rank maps: full parameters are
  // views of them (dp_fsdp.h, "Full parameters as views").
  bool full_params_as_views = false;
  // An argument error the caller found on this rank: refused in the
  // creation's place, so that with init_sync every rank fails naming it.
  std::string argument_error;
};

// How torch.chunk(world) splits `rows` rows: rank r's first row and count.
struct RowSplit {
  int64_t chunk = 0;  // ceil(rows / world): the padded rows of every rank
  int64_t start = 0;
  int64_t count = 0;
};
RowSplit split_rows(int64_t rows, int32_t world, int32_t rank);

class FullyShard final : public lane::LaneOwner,
                         public ParameterSharding,
                         public std::enable_shared_from_this<FullyShard> {
 public:
  using Clock = std::chrono::steady_clock;

  // Collective with init_sync (every rank must call it). The parameters of
  // `module` that no live dp_fsdp holds become this one's; one a live dp_ddp
  // holds is kInvalidArgument.
  static std::shared_ptr<FullyShard> create(std::shared_ptr<Module> module, std::shared_ptr<dist::ProcessGroup> group,
                                            const ShardingOptions& options);
  ~FullyShard() override;
  FullyShard(const FullyShard&) = delete;
  FullyShard& operator=(const FullyShard&) = delete;

  // dp_fsdp_destroy, collective: the slots get the full parameters back
  // (gathered) and the parameters are free for another dp_fsdp or dp_ddp.
  // When the gather fails, the slots keep this rank's shards; the error is
  // thrown after everything is released.
  void close();

  // `host_ready`: where the device queues the library's work, the host's
  // stream events (StreamOrder::kDeferred) the job's work follows.
  void unshard(bool async, std::vector<Event> host_ready = {});
  void wait_unshard();
  void reshard();
  void post_backward(std::vector<Event> host_ready = {});
  void finish_backward();
  void set_requires_gradient_sync(bool requires_sync);

  size_t num_parameters() const { return params_.size(); }
  const std::string& parameter_name(size_t index) const;
  Tensor shard(size_t index) const;
  Tensor shard_grad(size_t index) const;
  // Whether the slots hold the shards with no unshard in flight.
  bool resharded() const;
  const std::shared_ptr<dist::ProcessGroup>& group() const { return group_; }
  // Parameter `index`'s full value in its own dtype, gathered from every
  // rank (collective, on the lane).
  std::vector<Tensor> gather_full_values();
  // This rank's gather_full_values, refused for `reason`: its job, and when
  // the gather makes a collective, the refusal in its place, so that the
  // other ranks' gather fails naming this rank, and the verdict is thrown;
  // else returns (there is nothing to stand in for).
  void refuse_gather(const std::string& reason);
  // Runs `fn` on the lane as this dp_fsdp's next job, tagged `item`: the
  // collectives of a state dict's save or load, which every rank makes.
  void call_on_lane(dist::CallItem item, const std::function<void()>& fn);
  // Which parameter (index) holds `parameter`, or npos.
  size_t index_of(const Parameter* parameter) const;
  static constexpr size_t npos = ~size_t(0);
  // Parameter `index`'s full shape and own dtype (its shard's).
  const Shape& full_shape(size_t index) const { return params_.at(index).full_shape; }
  DType dtype(size_t index) const { return params_.at(index).dtype; }
  // The row split of parameter `index` on `rank` (0-d parameters: whole).
  RowSplit split_of(size_t index, int32_t rank) const;
  // Copies the rows of `full` (the parameter's full shape and any dtype it
  // casts from) that this rank keeps into its shard.
  void load_shard_from_full(size_t index, const Tensor& full);

  // LaneOwner.
  const char* owner_kind() const override { return "dp_fsdp"; }
  lane::JobResult run_job(const lane::JobSpec& spec) override;
  void complete_job(const lane::JobSpec& spec, lane::JobResult result) override;
  void drop_job(const lane::JobSpec& spec, StatusCode code, const std::string& why) override;

  // ParameterSharding.
  std::string grad_refusal(const Parameter& parameter) const override;
  void zero_shard_grad(const Parameter& parameter) override;

 private:
  FullyShard(std::shared_ptr<Module> module, std::shared_ptr<dist::ProcessGroup> group, ShardingOptions options);
  void init();

  struct Managed {
    std::string name;
    std::shared_ptr<Parameter> parameter;
    DType dtype = DType::kFloat32;    // the shard's: the parameter's own
    DType compute = DType::kFloat32;  // the full parameter's while unsharded
    DType reduce = DType::kFloat32;
    Shape full_shape;
    bool sharded = true;  // false for a 0-d parameter
    bool reduced = true;  // requires grad at create: its gradient is reduced
    int64_t row_numel = 1;
    RowSplit split;
    size_t reduce_offset = 0;  // elements into a rank's reduce segment of its dtype
    Tensor shard, shard_grad;
  };
  // A job issued on the lane and how it ended.
  struct Pending {
    bool issued = false;
    bool done = false;
    StatusCode code = StatusCode::kOk;
    std::string error;
  };
  enum class State { kResharded, kUnsharding, kUnsharded };

  // Checks and collects the parameters; with init_sync an argument error
  // is kept for the agreement check instead of thrown.
  std::string collect();
  std::vector<std::string> describe_for_agreement(const std::string& local_error) const;
  void plan_layout();
  // Each sharded parameter's offset (bytes) when each takes bytes_of(it),
  // starting on a cache line, and the total.
  std::vector<size_t> sharded_layout(const std::function<size_t(const Managed&)>& bytes_of, size_t* total) const;
  // The all-gather segment's layout in the compute dtype or the parameters'
  // own: each sharded parameter's offset (bytes), and the segment's size.
  std::vector<size_t> segment_offsets(bool compute_dtype, size_t* segment) const;
  // On a shared-memory group (with init_sync): the shards in memory every
  // rank maps, at the own-dtype segment's offsets, so that the all-gather
  // reads the other ranks' shards where they lie.
  bool wants_shard_region() const;
  // full_params_as_views asked for, on such a group, and no sharded
  // parameter cast to another compute dtype.
  bool wants_views() const;
  void create_shard_region();
  void shard_parameters();

  void issue_locked(lane::JobSpec spec, Pending& pending);
  // Waits for `pending`, bounded; rethrows its error. On success the host's
  // current stream follows the job's queued work (follow_job_locked).
  void wait_locked(std::unique_lock<std::mutex>& lock, Pending& pending, const char* what);
  // Makes this thread's current stream for the group's device wait for
  // `done` (or waits on the host without one, mutex_ released: true), then
  // forgets it.
  static bool follow_job_locked(std::unique_lock<std::mutex>& lock, std::optional<Event>& done);
  // Waits for the work of jobs nobody followed (their waiters gave up) and
  // drops their results, before the memory they write is freed.
  void settle_queued_work() noexcept;
  // Completes an unshard in flight (no-op otherwise): the slots get the full parameters.
  void finish_unshard_locked(std::unique_lock<std::mutex>& lock);
  void install_full_locked();
  void reshard_locked();
  void check_usable_locked() const;
  Clock::duration lane_bound() const;

  // On the lane: every parameter's full value, in the compute dtype or the
  // parameter's own, from one all_gather of every rank's segment.
  std::vector<Tensor> gather_shards(bool compute_dtype);
  // gather_shards with views: a barrier (every rank's shards are written),
  // then the full parameters as views of the region, or copies of them
  // (`as_views` false: a second barrier keeps every rank's shards as they
  // are until all have copied).
  std::vector<Tensor> full_from_views(bool as_views);
  void run_post_backward();
  // Whether a post_backward's job reduces anything (a collective even with
  // nothing to reduce: with views, a barrier).
  bool reduces() const;
  bool post_backward_communicates() const { return views_ || reduces(); }

  std::shared_ptr<Module> module_;
  std::shared_ptr<dist::ProcessGroup> group_;
  ShardingOptions options_;
  std::shared_ptr<lane::CommLane> lane_;
  uint32_t lane_id_ = 0;
  std::vector<Managed> params_;
  std::map<const Parameter*, size_t> index_;
  std::map<DType, size_t> reduce_segment_;  // one rank's reduce segment (elements) per reduce dtype
  // Per reduce dtype whose sharded parameters all have that dtype: their
  // shard gradients are views of one tensor laid out as the reduce segment,
  // which the reduce_scatter accumulates into (no result to add afterwards).
  std::map<DType, Tensor> shard_grad_segment_;
  std::shared_ptr<Storage> shard_region_;  // create_shard_region's, or null
  // With views: shard_region_ is every rank's part as one, and sharded
  // parameter i's full rows start at full_offsets_[i] (rank 0's shard first).
  bool views_ = false;
  std::vector<size_t> full_offsets_;

  mutable std::mutex host_mutex_;  // serialises the host's calls
  mutable std::mutex mutex_;       // what the lane and the host share
  std::condition_variable cv_;
  State state_ = State::kResharded;
  bool unsharded_since_post_ = false;  // an unshard since the last post_backward
  bool requires_sync_ = true;
  bool broken_ = false;
  bool closed_ = false;
  std::string broken_why_;
  uint32_t iteration_ = 0;
  Pending unshard_job_, post_job_;
  // The host's stream events each issued job's work follows (taken by the job).
  std::vector<Event> unshard_ready_, post_ready_;
  // After each job's queued work on the group's stream (QueuedTransfers).
  std::optional<Event> unshard_done_, post_done_;
  std::vector<Tensor> gathered_;    // the unshard job's full parameters
  std::vector<Tensor> post_grads_;  // the post_backward job's full gradients
};

}  // namespace dparallel::fsdp
