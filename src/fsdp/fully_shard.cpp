#include "fsdp/fully_shard.h"

#include <exception>
#include <optional>
#include <string>
#include <utility>

#include "core/device_runtime.h"
#include "core/error.h"
#include "distributed/background_calls.h"
#include "fsdp/fsdp_collectives.h"

namespace dparallel::fsdp {

namespace {

using dist::CallItem;

int64_t millis(FullyShard::Clock::duration d) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

// A job's end on a device that queues its work: an event after it, in
// `slot`, whatever way the job ends.
struct KeepEndEvent {
  std::mutex& mutex;
  const Device& device;
  std::optional<Event>& slot;
  ~KeepEndEvent() {
    if (!dist::QueuedTransfers::active()) return;
    std::optional<Event> done;
    try {
      done.emplace(device);
      done->record(device_runtime(device.type).library_stream(device.index));
    } catch (const std::exception&) {
      done.reset();  // the device failed: nothing left to follow
    }
    std::lock_guard<std::mutex> lock(mutex);
    slot = std::move(done);
  }
};

}  // namespace

FullyShard::Clock::duration FullyShard::lane_bound() const {
  // A post-backward with replicas is a job on each lane.
  return group_->timeout() + (replicate_ ? Clock::duration(replicate_->timeout()) : Clock::duration::zero()) +
         std::chrono::seconds(3);
}

FullyShard::~FullyShard() {
  if (closed_) return;
  // Not through close(): a destructor makes no collective.
  if (lane_) lane_->detach(this, lane_bound());
  if (replicate_lane_) replicate_lane_->detach(this, lane_bound());
  settle_queued_work();
  if (full_memory_) full_memory_->release();
  for (const ShardedParam& m : layout_.params()) m.parameter->release(this);
}

void FullyShard::close() {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  if (closed_) return;
  std::exception_ptr error;
  std::vector<Tensor> full;
  try {
    // Whatever is in flight ends first (its error, if any, is the close's).
    if (state_ == State::kUnsharding) {
      try {
        wait_locked(lock, unshard_job_, "the unshard");
        install_full_locked();
      } catch (...) {
        state_ = State::kResharded;
        gathered_.clear();
        throw;
      }
    }
  } catch (...) {
    if (!lock.owns_lock()) lock.lock();
    error = std::current_exception();
  }
  // The post-backward job ends first even when the unshard failed (unless a
  // wait already gave up on the lane).
  try {
    if (post_job_.issued && !broken_) wait_locked(lock, post_job_, "the post-backward reduce_scatter");
  } catch (...) {
    if (!error) error = std::current_exception();
  }
  // A job that failed (a peer's refusal, say) leaves the lane and the group
  // usable: the other ranks' destroy gathers, so this one does too.
  try {
    if (!broken_ && !layout_.params().empty()) {
      lock.unlock();
      lane::JobSpec spec;
      spec.item = CallItem::kGatherValues;
      spec.iteration = iteration_;
      lane_->call(
          this, spec, [&] { full = gather_full(layout_, *group_, FullKind::kOwn); }, lane_bound());
      lock.lock();
    }
  } catch (...) {
    if (!lock.owns_lock()) lock.lock();
    if (!error) error = std::current_exception();
  }
  closed_ = true;
  for (size_t i = 0; i < layout_.size(); ++i) {
    const ShardedParam& m = layout_.at(i);
    m.parameter->set_grad(Tensor());
    m.parameter->set_value(full.empty() ? m.shard : full[i]);
  }
  state_ = State::kResharded;
  lock.unlock();
  lane_->detach(this, lane_bound());
  if (replicate_lane_) replicate_lane_->detach(this, lane_bound());
  settle_queued_work();
  // A handle the host kept on a full parameter keeps its address reserved, without pages.
  if (full_memory_) full_memory_->release();
  for (const ShardedParam& m : layout_.params()) m.parameter->release(this);
  if (error) std::rethrow_exception(error);
}

void FullyShard::settle_queued_work() noexcept {
  std::optional<Event> unshard, post;
  std::vector<Tensor> gathered;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    unshard = std::exchange(unshard_done_, std::nullopt);
    post = std::exchange(post_done_, std::nullopt);
    gathered = std::move(gathered_);
    gathered_.clear();
  }
  // A job that ended after its waiter gave up may still write memory the
  // shards' owners free next, and the full parameters it gathered (freed
  // below, once it is done); the watch's abort bounds these waits.
  for (std::optional<Event>* done : {&unshard, &post}) {
    if (!*done) continue;
    try {
      (*done)->synchronize();
    } catch (...) {
    }
  }
}

const std::string& FullyShard::parameter_name(size_t index) const {
  if (index >= layout_.size()) {
    fail_invalid("argument 'index' is ", index, " but the dp_fsdp manages ", layout_.size(), " parameters");
  }
  return layout_.at(index).name;
}

Tensor FullyShard::shard(size_t index) const {
  parameter_name(index);
  return layout_.at(index).shard;
}

Tensor FullyShard::shard_grad(size_t index) const {
  parameter_name(index);
  return layout_.at(index).shard_grad;
}

bool FullyShard::resharded() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return state_ == State::kResharded;
}

// ---- the host's calls ----

void FullyShard::check_usable_locked() const {
  if (closed_) fail(StatusCode::kState, "the dp_fsdp is destroyed");
  if (lane_->on_worker()) {
    fail(StatusCode::kState, "called on the process group's comm lane (from a comm hook), which it would wait for");
  }
  if (broken_) fail(StatusCode::kState, broken_why_, "; the dp_fsdp is unusable");
}

void FullyShard::issue_locked(lane::JobSpec spec, Pending& pending) {
  pending = Pending{};
  pending.issued = true;
  spec.iteration = iteration_;
  if (!lane_->push(shared_from_this(), std::move(spec))) {
    pending.done = true;
    pending.code = lane_->stuck_code();
    pending.error = lane_->stuck_reason();
  }
}

void FullyShard::wait_locked(std::unique_lock<std::mutex>& lock, Pending& pending, const char* what) {
  dist::BackgroundCalls::Awaited awaited;
  const auto bound = lane_bound();
  if (!cv_.wait_for(lock, bound, [&] { return pending.done; })) {
    broken_ = true;
    lock.unlock();
    std::string missing = lane_->ranks_missing_next_job(this);
    if (missing.empty() && replicate_lane_ && &pending == &post_job_) {
      if (std::string replicas = replicate_lane_->ranks_missing_next_job(this); !replicas.empty()) {
        missing = "(of the replicate group) " + replicas;
      }
    }
    std::string why =
        str_cat(what, " of dp_fsdp #", lane_id_, " did not finish within ", millis(bound), " ms",
                missing.empty() ? std::string(" (a rank never issued it, or a job before it hung)")
                                : str_cat(": rank ", missing, " had not issued it (did ",
                                          missing.find(',') == std::string::npos ? "it" : "they", " skip this call?)"));
    lane_->give_up(why);
    if (replicate_lane_) replicate_lane_->give_up(why);
    lock.lock();
    broken_why_ = why;
    fail(StatusCode::kTimeout, why, "; the dp_fsdp is unusable");
  }
  Pending ended = pending;
  pending = Pending{};
  // Failed or not, the host's stream follows what the job queued: a failed
  // job may have queued writes to the shard gradients.
  const bool waited_on_host = follow_job_locked(lock, &pending == &unshard_job_ ? unshard_done_ : post_done_);
  if (ended.code != StatusCode::kOk)
    throw Error(ended.code, str_cat(what, " of dp_fsdp #", lane_id_, ": ", ended.error));
  // Waited for on the host: a queued collective that failed meanwhile is
  // this call's failure (with a stream, the next call reports it).
  if (waited_on_host) {
    const std::string broken = group_->broken_reason();
    if (!broken.empty()) fail(StatusCode::kState, what, " of dp_fsdp #", lane_id_, ": ", broken);
  }
}

bool FullyShard::follow_job_locked(std::unique_lock<std::mutex>& lock, std::optional<Event>& done) {
  if (!done) return false;
  Event end = std::move(*done);
  done.reset();
  // The host's stream as StreamOrder::finish would order it: the job's
  // results (and its frees of what the host drops next) come after it.
  if (void* stream = current_stream(end.device())) {
    end.block(stream);
    return false;
  }
  lock.unlock();  // the lane takes mutex_ meanwhile
  try {
    end.synchronize();
  } catch (...) {
    lock.lock();
    throw;
  }
  lock.lock();
  return true;
}

void FullyShard::install_full_locked() {
  for (size_t i = 0; i < layout_.size(); ++i) layout_.at(i).parameter->set_value(gathered_[i]);
  gathered_.clear();
  state_ = State::kUnsharded;
}

void FullyShard::reshard_locked() {
  for (const ShardedParam& m : layout_.params()) m.parameter->set_value(m.shard);
  state_ = State::kResharded;
  // After the host's stream has passed its reads of them (dp_fsdp.h).
  if (full_memory_) full_memory_->release();
}

void FullyShard::unshard(bool async, std::vector<Event> host_ready) {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  if (state_ == State::kResharded) {
    lane::JobSpec spec;
    spec.item = CallItem::kUnshard;
    unshard_ready_ = std::move(host_ready);
    if (!layout_.params().empty()) issue_locked(spec, unshard_job_);
    state_ = State::kUnsharding;
    unsharded_since_post_ = true;
    posted_by_marks_ = false;
  }
  if (!async) finish_unshard_locked(lock);
}

void FullyShard::finish_unshard_locked(std::unique_lock<std::mutex>& lock) {
  if (state_ != State::kUnsharding) return;
  try {
    if (!layout_.params().empty()) wait_locked(lock, unshard_job_, "the unshard");
  } catch (...) {
    state_ = State::kResharded;
    gathered_.clear();
    if (full_memory_) full_memory_->release();
    throw;
  }
  install_full_locked();
}

void FullyShard::wait_unshard() {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  if (state_ == State::kResharded) {
    fail(StatusCode::kState,
         "no unshard is in flight and the slots hold this rank's shards: call dp_fsdp_unshard first");
  }
  finish_unshard_locked(lock);
}

void FullyShard::reshard() {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  // ZeRO-2: the parameters stay unsharded from the forward to post_backward.
  if (!options_.reshard_after_forward && unsharded_since_post_) {
    finish_unshard_locked(lock);
    return;
  }
  finish_unshard_locked(lock);
  if (state_ == State::kUnsharded) reshard_locked();
}

void FullyShard::post_backward(std::vector<Event> host_ready) {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  // The marks ran it already (dp_fsdp.h, "Per-parameter marks").
  if (posted_by_marks_) return;
  post_backward_locked(lock, std::move(host_ready));
}

void FullyShard::post_backward_locked(std::unique_lock<std::mutex>& lock, std::vector<Event> host_ready,
                                      const std::string& forced_refusal) {
  if (!unsharded_since_post_) {
    fail(StatusCode::kState, "dp_fsdp #", lane_id_,
         " was not unsharded since its last post_backward, so no full gradient can have been computed: call "
         "dp_fsdp_unshard before the module's forward and backward");
  }
  // The last reduce_scatter's shard gradients are final before this one adds
  // to them. Its failure (a peer's refusal, say), not yet reported by a
  // finish_backward, fails this call, in its job's place: the other ranks
  // issue theirs.
  std::string previous;
  if (post_job_.issued) {
    try {
      wait_locked(lock, post_job_, "the post-backward reduce_scatter");
    } catch (const Error& e) {
      if (broken_) throw;
      previous = str_cat("the previous post_backward failed, and no dp_fsdp_finish_backward reported it: ", e.what());
    }
  }
  // This backward's marks end here, whatever the outcome; the gradients of
  // those left unmarked are reduced as they are.
  clear_marks_locked();
  host_ready.insert(host_ready.end(), std::make_move_iterator(marks_ready_.begin()),
                    std::make_move_iterator(marks_ready_.end()));
  marks_ready_.clear();
  finish_unshard_locked(lock);
  std::vector<Tensor> grads(layout_.size());
  std::string refusal;
  for (size_t i = 0; i < layout_.size(); ++i) {
    const ShardedParam& m = layout_.at(i);
    if (!m.reduced) continue;
    grads[i] = m.parameter->grad_if_allocated();
    if (grads[i].defined() && (grads[i].shape() != m.full_shape || grads[i].dtype() != m.compute)) {
      if (refusal.empty()) {
        refusal = str_cat("parameter '", m.name, "' has the gradient ", grads[i].describe(),
                          " but its full gradient is ", dtype_name(m.compute), " ", shape_string(m.full_shape),
                          ": set a gradient while the parameter is unsharded");
      }
      // Never reduced nor kept: the next backward starts it afresh.
      m.parameter->set_grad(Tensor());
      grads[i] = Tensor();
    }
  }
  if (!refusal.empty()) refusal += " (the gradient was dropped)";
  if (!forced_refusal.empty()) refusal = forced_refusal;
  if (refusal.empty()) refusal = previous;
  // Refused or not, the call reshards as on every rank, so that the ranks'
  // next unshards still pair.
  unsharded_since_post_ = false;
  reshard_locked();
  // Without sync the full gradients stay and the next backward adds to them.
  if (!requires_sync_ || layout_.params().empty() || (!refusal.empty() && !reduce_communicates(layout_))) {
    // No collective for anyone to pair a refusal with.
    if (!refusal.empty()) fail_invalid(refusal);
    return;
  }
  for (const ShardedParam& m : layout_.params()) {
    if (m.reduced) m.parameter->set_grad(Tensor());
  }
  post_ready_ = std::move(host_ready);
  lane::JobSpec spec;
  spec.item = CallItem::kPostBackward;
  if (refusal.empty()) {
    post_grads_ = std::move(grads);
  } else {
    // In the reduce-scatter's place: the other ranks' post_backward fails
    // naming this rank, and every rank stays in step.
    spec.refusal = refusal;
  }
  issue_locked(spec, post_job_);
  ++iteration_;
  if (!refusal.empty()) {
    wait_locked(lock, post_job_, "the post-backward reduce_scatter");
    fail(StatusCode::kInternal, "dp_fsdp #", lane_id_, ": a refused post_backward passed");
  }
}

void FullyShard::finish_backward() {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  finish_marked_backward_locked(lock);
  if (post_job_.issued) wait_locked(lock, post_job_, "the post-backward reduce_scatter");
}

void FullyShard::set_requires_gradient_sync(bool requires_sync) {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::lock_guard<std::mutex> lock(mutex_);
  check_usable_locked();
  requires_sync_ = requires_sync;
}

std::vector<Tensor> FullyShard::gather_full_values() {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  finish_unshard_locked(lock);
  if (layout_.params().empty()) return {};
  lock.unlock();
  std::vector<Tensor> full;
  lane::JobSpec spec;
  spec.item = CallItem::kGatherValues;
  spec.iteration = iteration_;
  lane_->call(
      this, spec, [&] { full = gather_full(layout_, *group_, FullKind::kOwn); }, lane_bound());
  return full;
}

void FullyShard::refuse_gather(const std::string& reason) {
  std::lock_guard<std::mutex> host(host_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  finish_unshard_locked(lock);
  // As gather_full_values: a job (the lane numbers them) when there is a
  // parameter, and a collective in it as gather_full makes one.
  if (layout_.params().empty()) return;
  const bool communicates = gather_communicates(layout_);
  lane::JobSpec spec;
  spec.item = CallItem::kGatherValues;
  spec.iteration = iteration_;
  lock.unlock();
  lane_->call(
      this, spec,
      [&] {
        if (communicates) group_->refuse(dist::CallKind::kAllGather, reason, false);
      },
      lane_bound());
  if (communicates) fail(StatusCode::kInternal, "dp_fsdp #", lane_id_, ": a refused gather passed");
}

void FullyShard::call_on_lane(CallItem item, const std::function<void()>& fn) {
  std::lock_guard<std::mutex> host(host_mutex_);
  {
    std::unique_lock<std::mutex> lock(mutex_);
    check_usable_locked();
  }
  lane::JobSpec spec;
  spec.item = item;
  spec.iteration = iteration_;
  lane_->call(this, spec, fn, lane_bound());
}

void FullyShard::call_on_replicate_lane(CallItem item, const std::function<void()>& fn) {
  std::lock_guard<std::mutex> host(host_mutex_);
  {
    std::unique_lock<std::mutex> lock(mutex_);
    check_usable_locked();
  }
  if (!replicate_lane_) fail(StatusCode::kInternal, "dp_fsdp #", lane_id_, " has no replicate group");
  lane::JobSpec spec;
  spec.item = item;
  spec.iteration = iteration_;
  replicate_lane_->call(this, spec, fn, lane_bound());
}

// ---- on the lane ----

lane::JobResult FullyShard::run_job(const lane::JobSpec& spec) {
  if (spec.item == CallItem::kReplicaReduce) return run_replica_reduce(spec);
  return lane::timed_job([&](lane::JobResult& /*result*/) {
    // On NCCL the job's work all goes on the group's stream, after the
    // host's stream as it was at the call, and the job returns once it is
    // queued; an end event recorded however the job ends (its own frees
    // follow that stream already) is what the host follows
    // (follow_job_locked).
    if (!spec.refusal.empty()) {
      // Stands in for the job's first collective: the verdict names this rank.
      group_->refuse(spec.item == CallItem::kUnshard ? dist::CallKind::kAllGather : dist::CallKind::kReduceScatter,
                     spec.refusal, false);
    }
    const Device device = group_->device();
    dist::QueuedTransfers queued(device, group_->transfer_stream());
    const bool unshard = spec.item == CallItem::kUnshard;
    std::vector<Event> host_ready;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      host_ready = std::move(unshard ? unshard_ready_ : post_ready_);
    }
    library_streams_wait(host_ready);
    KeepEndEvent keep{mutex_, device, unshard ? unshard_done_ : post_done_};
    if (unshard) {
      // The pages come back here, so that running out of them fails the
      // job as the all-gather's own allocations would.
      if (full_memory_) full_memory_->back();
      std::vector<Tensor> full = gather_full(layout_, *group_, FullKind::kCompute, &full_);
      std::lock_guard<std::mutex> lock(mutex_);
      gathered_ = std::move(full);
    } else if (spec.item == CallItem::kPostBackward) {
      std::vector<Tensor> grads;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        grads = std::move(post_grads_);
        post_grads_.clear();
      }
      ReplicaSums sums;
      reduce_gradients(layout_, *group_, std::move(grads), replicate_ ? &sums : nullptr);
      std::lock_guard<std::mutex> lock(mutex_);
      replica_sums_ = std::move(sums);
    } else {
      fail(StatusCode::kInternal, "a dp_fsdp job of ", dist::call_item_name(spec.item, 0));
    }
  });
}

void FullyShard::issue_replica_reduce(const lane::JobSpec& post, const lane::JobResult& result) {
  lane::JobSpec spec;
  spec.item = CallItem::kReplicaReduce;
  spec.iteration = post.iteration;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    shard_result_ = result;
    if (result.code != StatusCode::kOk) {
      // In the all-reduce's place: the other replicas' post_backward fails
      // naming this rank, and every replica stays in step.
      spec.refusal = str_cat("its shard group's reduce_scatter failed: ", result.error);
      replica_sums_ = ReplicaSums{};
    }
  }
  StatusCode code = result.code;
  std::string error = result.error;
  try {
    if (replicate_lane_->push(shared_from_this(), std::move(spec))) return;
    if (code == StatusCode::kOk) {
      code = replicate_lane_->stuck_code();
      error = replicate_lane_->stuck_reason();
    }
  } catch (const std::exception& e) {
    if (code == StatusCode::kOk) {
      code = StatusCode::kInternal;
      error = e.what();
    }
  }
  // Not issued: the post-backward ends here.
  std::lock_guard<std::mutex> lock(mutex_);
  replica_sums_ = ReplicaSums{};
  post_job_.done = true;
  post_job_.code = code;
  post_job_.error = error;
  cv_.notify_all();
}

lane::JobResult FullyShard::run_replica_reduce(const lane::JobSpec& spec) {
  return lane::timed_job([&](lane::JobResult& result) {
    if (!spec.refusal.empty()) {
      // This rank's post_backward fails as its reduce-scatter did.
      try {
        replicate_->refuse(dist::CallKind::kAllReduce, spec.refusal, false);
      } catch (const Error&) {
      }
      std::lock_guard<std::mutex> lock(mutex_);
      result.code = shard_result_.code;
      result.error = shard_result_.error;
    } else {
      // On NCCL, after the reduce-scatter's queued work (the host follows
      // this job's end instead).
      const Device device = replicate_->device();
      dist::QueuedTransfers queued(device, replicate_->transfer_stream());
      ReplicaSums sums;
      std::vector<Event> shard_done;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        sums = std::move(replica_sums_);
        replica_sums_ = ReplicaSums{};
        if (post_done_) shard_done.push_back(std::move(*post_done_));
        post_done_.reset();
      }
      library_streams_wait(shard_done);
      KeepEndEvent keep{mutex_, device, post_done_};
      reduce_across_replicas(std::move(sums), *replicate_);
    }
  });
}

void FullyShard::complete_job(const lane::JobSpec& spec, lane::JobResult result) {
  // With replicas, the post-backward ends once its all-reduce across them did.
  if (replicate_ && spec.item == CallItem::kPostBackward) {
    issue_replica_reduce(spec, result);
    return;
  }
  std::lock_guard<std::mutex> lock(mutex_);
  Pending& pending = spec.item == CallItem::kUnshard ? unshard_job_ : post_job_;
  pending.done = true;
  pending.code = result.code;
  pending.error = std::move(result.error);
  cv_.notify_all();
}

void FullyShard::drop_job(const lane::JobSpec& spec, StatusCode code, const std::string& why) {
  std::lock_guard<std::mutex> lock(mutex_);
  Pending& pending = spec.item == CallItem::kUnshard ? unshard_job_ : post_job_;
  pending.done = true;
  pending.code = code;
  pending.error = why;
  cv_.notify_all();
}

// ---- ParameterSharding ----

std::string FullyShard::grad_refusal(const Parameter& parameter) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_ == State::kUnsharded || closed_) return "";
  const size_t index = index_of(&parameter);
  if (index == npos) return "";
  const ShardedParam& m = layout_.at(index);
  std::string held = m.sharded ? str_cat("rows [", m.split.start, ", ", m.split.start + m.split.count, ") of ",
                                         shape_string(m.full_shape))
                               : std::string("a copy of the 0-d parameter");
  return str_cat("parameter '", m.name, "' is sharded by dp_fsdp #", lane_id_, " and its slot holds this rank's ", held,
                 state_ == State::kUnsharding ? " (an unshard is in flight: dp_fsdp_wait_unshard)"
                                              : " (call dp_fsdp_unshard first)",
                 "; its full gradient, ", dtype_name(m.compute), " ", shape_string(m.full_shape),
                 ", is taken or set while it is unsharded; the shard's gradient is dp_fsdp_shard_grad");
}

void FullyShard::zero_shard_grad(const Parameter& parameter) {
  const size_t index = index_of(&parameter);
  if (index == npos) return;
  std::exception_ptr failed;
  bool waited = false;
  {
    // A post_backward in flight adds into the shard gradients: it ends
    // first (as in dp_fsdp_finish_backward, whose error this call then
    // reports), so that the zeros are not added to, nor raced with.
    std::lock_guard<std::mutex> host(host_mutex_);
    std::unique_lock<std::mutex> lock(mutex_);
    if (post_job_.issued && !broken_ && !closed_) {
      if (lane::running_hook().owner != nullptr) {
        fail(StatusCode::kState, "zeroing the gradient of parameter '", layout_.at(index).name, "': dp_fsdp #",
             lane_id_,
             "'s post_backward is in flight, and this call runs inside a dp_ddp callback (which may run on the "
             "comm lane the post_backward needs); zero the gradients after dp_fsdp_finish_backward");
      }
      waited = true;
      try {
        wait_locked(lock, post_job_, "the post-backward reduce_scatter");
      } catch (...) {
        // Ended with an error: its writes were followed all the same, so
        // zero, then report. Not ended (this wait gave up, the dp_fsdp is
        // broken): it may still write, so the gradients stay as they are.
        if (broken_) throw;
        failed = std::current_exception();
      }
    }
  }
  const Tensor& g = layout_.at(index).shard_grad;
  {
    // The host's stream now follows the job's writes; the fill, on the
    // library stream, follows the host's stream again.
    std::optional<StreamOrder> after_job;
    if (waited) after_job.emplace(std::vector<Device>{g.device()});
    fill_zero(g.data(), g.device(), g.nbytes());
  }
  if (failed) std::rethrow_exception(failed);
}

}  // namespace dparallel::fsdp
