// fully_shard (PyTorch's FSDP2) over a module's parameters: each rank keeps
// its rows of every parameter (sharded_param.h has the layout); unshard
// all-gathers them into full parameters, post_backward reduce-scatters the
// full gradients into the shards' gradients (fsdp_collectives.h). Every
// collective is a job on the group's comm lane (ddp/comm_lane.h), so dp_ddp
// and several dp_fsdp on one group pair their calls by identity whatever
// order the host issues them in. This file is the state machine over those
// jobs and the host's calls; fully_shard_create.cpp makes one.
//
// One all-gather per unshard: every sharded parameter's rows, cast to the
// compute dtype, lie in one flat byte buffer per rank (a segment), so that
// rank r's segment is the same layout on every rank. The gradients go the
// same way back, one reduce-scatter per reduce dtype. A 0-d parameter is
// not sharded: every rank holds it whole and its gradient is all-reduced.
//
// With full_params_as_views on a shared-memory group, the shards are laid
// out as the full parameters instead, in memory every rank maps: an unshard
// is a barrier and the full parameters are views (dp_fsdp.h has the host's
// side of that).
//
// HSDP (hybrid sharding): with a replicate group, every rank of it holds
// the same shards (the same rank of a shard group alike), and post_backward
// all-reduces the reduce-scattered shard gradients across it, as a job of
// the dp_fsdp on the replicate group's own comm lane: it overlaps the next
// reduce-scatters as they overlap the backward, and the replicate group,
// driven by that lane's thread alone, pairs its calls by identity too.
//
// The host drives one dp_fsdp from one thread at a time; calls from several
// threads are serialised.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/releasable_memory.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "distributed/process_group.h"
#include "fsdp/fsdp_collectives.h"
#include "fsdp/sharded_param.h"
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
  // HSDP: the parameters sharded over `shard_group` as above, and each
  // shard replicated across `replicate_group` (null: none, as above), whose
  // ranks are the same rank of shard groups of the same size. A 2-D device
  // mesh (replicas, shards) maps its dim 1 (e.g. the ranks of a host) to
  // the shard group and its dim 0 to the replicate group; a 1-D mesh is a
  // shard group alone. Gradients are reduce-scattered in the shard group,
  // then all-reduced across the replicas: averaged over both groups' ranks.
  // With init_sync, the replicas' agreement on the parameters and the
  // shards' layout is checked too (a difference on any rank fails every
  // rank's create, naming it), and every rank starts from the values of
  // rank 0 of both groups. Collective over both groups (without init_sync
  // no collective: the host vouches that the replicas agree). The C ABI's
  // dp_fsdp_create_on_mesh calls this with its mesh's groups.
  static std::shared_ptr<FullyShard> create(std::shared_ptr<Module> module,
                                            std::shared_ptr<dist::ProcessGroup> shard_group,
                                            std::shared_ptr<dist::ProcessGroup> replicate_group,
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
  // dp_fsdp_mark_grad_ready (fully_shard_marks.cpp): the gradient of managed
  // parameter `name` is final; the mark that completes the set runs
  // post_backward on its thread, after every marking thread's stream.
  void mark_grad_ready(const std::string& name, std::vector<Event> host_ready = {});
  void finish_backward();
  void set_requires_gradient_sync(bool requires_sync);

  size_t num_parameters() const { return layout_.size(); }
  const std::string& parameter_name(size_t index) const;
  Tensor shard(size_t index) const;
  Tensor shard_grad(size_t index) const;
  // Whether the slots hold the shards with no unshard in flight.
  bool resharded() const;
  // The shard group.
  const std::shared_ptr<dist::ProcessGroup>& group() const { return group_; }
  // The replicate group (HSDP), or null.
  const std::shared_ptr<dist::ProcessGroup>& replicate_group() const { return replicate_; }
  // Whether this rank writes the sharded state dicts: rank 0 of the
  // replicate group (every rank without one).
  bool writes_shards() const { return !replicate_ || replicate_->rank() == 0; }
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
  // call_on_lane on the replicate group's lane (HSDP only).
  void call_on_replicate_lane(dist::CallItem item, const std::function<void()>& fn);
  // Which parameter (index) holds `parameter`, or npos.
  size_t index_of(const Parameter* parameter) const { return layout_.index_of(parameter); }
  static constexpr size_t npos = ShardLayout::npos;
  // Parameter `index`'s full shape and own dtype (its shard's).
  const Shape& full_shape(size_t index) const { return layout_.at(index).full_shape; }
  DType dtype(size_t index) const { return layout_.at(index).dtype; }
  // The row split of parameter `index` on `rank` (0-d parameters: whole).
  RowSplit split_of(size_t index, int32_t rank) const { return layout_.at(index).split_on(group_->size(), rank); }
  // Copies the rows of `full` (the parameter's full shape and any dtype it
  // casts from) that this rank keeps into its shard.
  void load_shard_from_full(size_t index, const Tensor& full) { layout_.load_shard_from_full(index, full); }

  // LaneOwner.
  const char* owner_kind() const override { return "dp_fsdp"; }
  lane::JobResult run_job(const lane::JobSpec& spec) override;
  void complete_job(const lane::JobSpec& spec, lane::JobResult result) override;
  void drop_job(const lane::JobSpec& spec, StatusCode code, const std::string& why) override;

  // ParameterSharding.
  std::string grad_refusal(const Parameter& parameter) const override;
  void zero_shard_grad(const Parameter& parameter) override;

 private:
  FullyShard(std::shared_ptr<Module> module, std::shared_ptr<dist::ProcessGroup> group,
             std::shared_ptr<dist::ProcessGroup> replicate, ShardingOptions options);
  void init();
  // With init_sync: the agreement checks and the broadcasts of rank 0's
  // values, over the shard group and then the replicate group; every rank
  // of both fails alike.
  void agree_on_lanes(const std::string& local_error);
  // A replicate group's problem before any collective (kInvalidArgument
  // text), or "".
  std::string replicate_argument_error() const;

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
  std::vector<std::string> describe_for_agreement(const std::string& local_error, bool for_replicas) const;
  // On a shared-memory group (with init_sync): the shards can lie in memory
  // every rank maps (ShardLayout::wanted_placement).
  bool wants_shard_region() const;
  // Collective: the region for `wanted`, into *region; the placement the
  // shards get (kPrivate when the region could not be made).
  ShardPlacement create_shard_region(ShardPlacement wanted, std::shared_ptr<Storage>* region);

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
  // The full parameters at the addresses they keep for the dp_fsdp's life
  // (views of the region where the layout has them), their pages released.
  void make_full_params();
  void install_full_locked();
  // The slots hold the shards; the full parameters' pages go.
  void reshard_locked();
  // post_backward past its checks; a `refusal` stands in for the reduce-scatter.
  void post_backward_locked(std::unique_lock<std::mutex>& lock, std::vector<Event> host_ready,
                            const std::string& refusal = "");
  // The managed parameters that require grad and this backward left
  // unmarked, quoted, while at least one is marked; else "".
  std::string unmarked_locked() const;
  // Forgets this backward's marks.
  void clear_marks_locked();
  // finish_backward with marks missing: post_backward refused in its
  // place, naming the unmarked parameters (the peers' fail naming this
  // rank), then kState naming them; nothing when no mark is missing.
  void finish_marked_backward_locked(std::unique_lock<std::mutex>& lock);
  void check_usable_locked() const;
  Clock::duration lane_bound() const;
  // HSDP, on the shard lane once a post-backward job ended: its all-reduce
  // across the replicas, issued on the replicate lane (a refusal there in
  // its place when the reduce-scatter failed). When the replicate lane is
  // stuck, the post-backward ends with that.
  void issue_replica_reduce(const lane::JobSpec& post, const lane::JobResult& result);
  lane::JobResult run_replica_reduce(const lane::JobSpec& spec);

  std::shared_ptr<Module> module_;
  std::shared_ptr<dist::ProcessGroup> group_;
  std::shared_ptr<dist::ProcessGroup> replicate_;  // HSDP's, or null
  ShardingOptions options_;
  std::shared_ptr<lane::CommLane> lane_;
  uint32_t lane_id_ = 0;
  std::shared_ptr<lane::CommLane> replicate_lane_;
  // The parameters, their shards, and where the shards lie (fixed by init).
  ShardLayout layout_;

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
  // Every full parameter's memory (null where none needs any): backed from
  // an unshard job to the next reshard, at one address throughout.
  std::shared_ptr<ReleasableMemory> full_memory_;
  std::vector<Tensor> full_;        // by parameter index, over full_memory_ (or views of the region)
  std::vector<Tensor> gathered_;    // the unshard job's full parameters
  std::vector<Tensor> post_grads_;  // the post_backward job's full gradients
  // This backward's marks (dp_fsdp_mark_grad_ready), per parameter index,
  // and the marking threads' stream events.
  std::vector<bool> marked_;
  size_t num_marked_ = 0;
  std::vector<Event> marks_ready_;
  bool posted_by_marks_ = false;  // the marks ran this backward's post_backward
  // HSDP: what the reduce-scatter left for the replicas' all-reduce, and how
  // the reduce-scatter ended (the all-reduce's refusal when it failed).
  ReplicaSums replica_sums_;
  lane::JobResult shard_result_;
};

}  // namespace dparallel::fsdp
