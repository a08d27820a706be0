#include "lane/comm_lane.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <vector>

#include "core/error.h"
#include "core/thread_name.h"
#include "core/thread_pool.h"
#include "distributed/background_calls.h"

namespace dparallel::lane {

namespace {

thread_local RunningHook t_running_hook;

}  // namespace

RunningHook running_hook() noexcept { return t_running_hook; }
RunningHookScope::RunningHookScope(RunningHook hook) { t_running_hook = hook; }
RunningHookScope::~RunningHookScope() { t_running_hook = RunningHook{}; }

namespace {

struct LaneEntry {
  std::weak_ptr<dist::ProcessGroup> group;
  std::weak_ptr<CommLane> lane;
  std::shared_ptr<CommLane::Counters> counters;
};
struct LaneRegistry {
  std::mutex mutex;
  std::map<const dist::ProcessGroup*, LaneEntry> lanes;
};
LaneRegistry& lane_registry() {
  static auto* registry = new LaneRegistry();  // outlives hosts' static destructors
  return *registry;
}

}  // namespace

std::shared_ptr<CommLane> CommLane::for_group(const std::shared_ptr<dist::ProcessGroup>& group) {
  LaneRegistry& registry = lane_registry();
  std::lock_guard<std::mutex> lock(registry.mutex);
  auto& lanes = registry.lanes;
  for (auto it = lanes.begin(); it != lanes.end();) it = it->second.group.expired() ? lanes.erase(it) : std::next(it);
  LaneEntry& entry = lanes[group.get()];
  if (entry.group.lock() != group) entry = LaneEntry{group, {}, std::make_shared<Counters>()};
  if (auto existing = entry.lane.lock()) return existing;
  auto created = std::make_shared<CommLane>(group, entry.counters);
  entry.lane = created;
  return created;
}

void CommLane::park_idle_lanes() {
  std::vector<std::shared_ptr<CommLane>> live;
  {
    LaneRegistry& registry = lane_registry();
    std::lock_guard<std::mutex> lock(registry.mutex);
    for (auto& [group, entry] : registry.lanes) {
      if (auto lane = entry.lane.lock()) live.push_back(std::move(lane));
    }
  }
  for (const auto& lane : live) lane->park_if_idle();
}

class CommLane::Gate : public dist::CallGate {
 public:
  explicit Gate(std::shared_ptr<State> state) : state_(std::move(state)) {}
  bool owns_this_thread() const override { return std::this_thread::get_id() == state_->worker.load(); }
  std::string refuse_host_call() override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    for (const auto& [owner, entry] : state_->owners) {
      if (!entry.in_backward && entry.jobs.empty()) continue;
      const std::string kind = entry.kind;
      const std::string pairs =
          str_cat("; a collective of the host's now would pair with a ", kind, "'s on some rank: make it ");
      if (entry.in_backward) {
        return str_cat(kind, " #", entry.id, " on this group is in a backward (from its first mark to the end of ",
                       kind, "_finish_backward)", pairs, "before the first mark or after every ", kind,
                       "_finish_backward");
      }
      return str_cat(kind, " #", entry.id, " on this group has collectives queued", pairs, "once they ran (after ",
                     kind, "_finish_backward, or the wait for what was issued)");
    }
    if (state_->running != nullptr) {
      return str_cat("a ", state_->running_kind, " on this group runs ", state_->running_name, "; call once it ended");
    }
    return "";
  }

 private:
  std::shared_ptr<State> state_;
};

CommLane::CommLane(std::shared_ptr<dist::ProcessGroup> group, std::shared_ptr<Counters> counters)
    : state_(std::make_shared<State>(std::move(group), std::move(counters))) {
  {
    std::lock_guard<std::mutex> threads(thread_mutex_);
    start_worker_locked();
  }
  gate_ = std::make_shared<Gate>(state_);
  state_->group->set_call_gate(gate_);
}

void CommLane::start_worker_locked() {
  if (thread_.joinable()) return;
  thread_ = std::thread([state = state_] {
    state->worker.store(std::this_thread::get_id());
    name_this_thread("dp-lane");
    dist::BackgroundCalls::mark_this_thread();
    // The jobs overlap the host's backward: a fan-out would take its cores.
    SerialScope serial;
    loop(state);
    state->worker.store(std::thread::id());
  });
}

bool CommLane::park_if_idle() {
  const auto deadline = Clock::now() + state_->group->timeout();
  std::unique_lock<std::mutex> threads(thread_mutex_);
  for (;;) {
    if (!thread_.joinable() || on_worker()) return false;
    std::unique_lock<std::mutex> lock(state_->mutex);
    // Issued jobs may wait for other ranks: not idle.
    if (has_pending_locked(*state_) || !state_->stuck.empty()) return false;
    if (state_->running == nullptr && state_->holding == nullptr) {
      state_->parking = true;
      state_->cv.notify_all();
      break;
    }
    // The job it runs or publishes is the last one issued and ends within
    // the group's timeout. Waited for without thread_mutex_, so a host
    // issuing the next job (holding its owner's lock) is never held up.
    threads.unlock();
    const bool settled = state_->cv.wait_until(lock, deadline, [&] {
      return has_pending_locked(*state_) || (state_->running == nullptr && state_->holding == nullptr);
    });
    if (!settled) return false;
    lock.unlock();
    threads.lock();
  }
  thread_.join();
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->parking = false;
  return true;
}

CommLane::~CommLane() {
  bool stuck = false;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->stopping = true;
    // Only a job that may never return (a hung hook) leaves the worker
    // behind; one that stopped for a failed round ends now.
    stuck = state_->running != nullptr && !state_->stuck.empty();
    state_->cv.notify_all();
  }
  // A worker stuck in a job (or this very thread, when the job's owner
  // held the lane's last reference) ends on its own; the state lives as long as it.
  std::lock_guard<std::mutex> threads(thread_mutex_);
  if (!thread_.joinable()) return;  // parked
  if (stuck || on_worker()) {
    thread_.detach();
  } else {
    thread_.join();
  }
}

std::string CommLane::stuck_reason() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->stuck;
}

StatusCode CommLane::stuck_code() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->stuck_code;
}

void CommLane::set_in_backward(const LaneOwner* owner, bool in_backward) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto it = state_->owners.find(owner);
  if (it != state_->owners.end()) it->second.in_backward = in_backward;
}

uint32_t CommLane::attach(const LaneOwner* owner) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  Owner& entry = state_->owners[owner];
  entry.kind = owner->owner_kind();
  entry.id = state_->counters->next_owner++;
  return entry.id;
}

void CommLane::Job::execute() {
  if (run) {
    run();
  } else {
    result = owner->run_job(spec);
  }
}

void CommLane::Job::publish() {
  if (complete) {
    complete();
  } else {
    owner->complete_job(spec, std::move(result));
  }
}

void CommLane::Job::drop_unrun(StatusCode code, const std::string& why) {
  if (drop) {
    drop(code, why);
  } else if (owner) {
    owner->drop_job(spec, code, why);
  }
}

std::string CommLane::job_name(const Job& job) {
  std::string name = dist::call_item_name(job.spec.item, static_cast<uint32_t>(job.spec.index));
  return job.spec.refusal.empty() ? name : name + " (refused)";
}

bool CommLane::push(const std::shared_ptr<LaneOwner>& owner, JobSpec spec) {
  std::lock_guard<std::mutex> threads(thread_mutex_);
  start_worker_locked();
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (!state_->stuck.empty()) return false;
  auto it = state_->owners.find(owner.get());
  if (it == state_->owners.end()) fail(StatusCode::kInternal, "a job of an owner that is not on the lane");
  Job job;
  job.owner = owner;
  job.spec = std::move(spec);
  job.number = it->second.issued++;
  it->second.jobs.push_back(std::move(job));
  ++state_->pushes;
  state_->cv.notify_all();
  return true;
}

void CommLane::call(const LaneOwner* owner, const JobSpec& spec, const std::function<void()>& fn,
                    Clock::duration bound) {
  const std::string what = dist::call_item_name(spec.item, static_cast<uint32_t>(spec.index));
  struct Outcome {
    bool started = false;
    bool abandoned = false;  // the caller gave up before it started
    bool done = false;
    std::exception_ptr error;
  };
  if (on_worker()) {
    fail(StatusCode::kState, what,
         ": called on the comm lane's own thread (from a comm hook), which would wait for itself");
  }
  auto outcome = std::make_shared<Outcome>();
  State& state = *state_;
  std::unique_lock<std::mutex> threads(thread_mutex_);
  start_worker_locked();
  std::unique_lock<std::mutex> lock(state.mutex);
  if (!state.stuck.empty()) fail(StatusCode::kState, what, ": ", state.stuck);
  auto it = state.owners.find(owner);
  if (it == state.owners.end()) fail(StatusCode::kInternal, what, ": its owner is not on the lane");
  // `fn` is the caller's, alive until this returns: the job runs it only
  // if it starts before the caller gives up, and the caller then waits.
  Job job;
  job.spec = spec;
  job.run = [&state, outcome, &fn] {
    {
      std::lock_guard<std::mutex> guard(state.mutex);
      if (outcome->abandoned) return;
      outcome->started = true;
      state.cv.notify_all();
    }
    std::exception_ptr error;
    try {
      fn();
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> guard(state.mutex);
    outcome->error = error;
  };
  job.complete = [&state, outcome] {
    std::lock_guard<std::mutex> guard(state.mutex);
    outcome->done = true;
    state.cv.notify_all();
  };
  job.drop = [&state, outcome, what](StatusCode code, const std::string& why) {
    std::lock_guard<std::mutex> guard(state.mutex);
    outcome->error = std::make_exception_ptr(Error(code, str_cat(what, ": ", why)));
    outcome->done = true;
    state.cv.notify_all();
  };
  job.number = it->second.issued++;
  it->second.jobs.push_back(std::move(job));
  ++state.pushes;
  state.cv.notify_all();
  threads.unlock();  // issued: the worker cannot park until it ran
  dist::BackgroundCalls::Awaited awaited;
  if (!state.cv.wait_for(lock, bound, [&] { return outcome->started || outcome->done; })) {
    // It keeps its place (every rank counts it) but runs nothing.
    outcome->abandoned = true;
    std::string before = state.running != nullptr
                             ? state.running_name + " (before it on this process group's comm lane)"
                             : std::string("the other ranks' matching call");
    fail(StatusCode::kTimeout, what, " did not start within ", millis(bound), " ms: ", before,
         " did not come (a comm hook that does not return, or a rank that does not issue it?)");
  }
  // Once started, its collectives end by the group's timeout.
  state.cv.wait(lock, [&] { return outcome->done; });
  if (outcome->error) std::rethrow_exception(outcome->error);
}

std::deque<CommLane::Job> CommLane::stick_locked(State& state, const std::string& why, StatusCode code) {
  if (state.stuck.empty()) {
    state.stuck = why;
    state.stuck_code = code;
  }
  std::deque<Job> dropped;
  for (auto& [owner, entry] : state.owners) {
    for (Job& job : entry.jobs) dropped.push_back(std::move(job));
    entry.jobs.clear();
  }
  state.cv.notify_all();
  return dropped;
}

void CommLane::drop_all(std::deque<Job>& jobs, StatusCode code, const std::string& why) {
  for (Job& job : jobs) job.drop_unrun(code, why);
  jobs.clear();
}

void CommLane::give_up(const std::string& why) {
  std::deque<Job> dropped;
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->running == nullptr && state_->stuck.empty()) return;
    dropped = stick_locked(*state_, str_cat("the process group's comm lane is stuck for good: ", state_->running_name,
                                            " has run for ", millis(Clock::now() - state_->running_since), " ms (", why,
                                            "); destroy the dp_ddp and dp_fsdp on it and make a new group"));
    reason = state_->stuck;
  }
  drop_all(dropped, StatusCode::kState, reason);
}

bool CommLane::detach(const LaneOwner* owner, Clock::duration bound) {
  std::deque<Job> dropped;
  std::string reason;
  bool ended = true;
  const std::string kind = owner->owner_kind();
  {
    std::unique_lock<std::mutex> lock(state_->mutex);
    auto it = state_->owners.find(owner);
    if (it != state_->owners.end()) {
      for (Job& job : it->second.jobs) dropped.push_back(std::move(job));
      state_->owners.erase(it);
    }
    if (!on_worker() && (state_->running == owner || state_->holding == owner)) {
      // Also past the running job's end: the worker lets go of the owner
      // before this returns, so that its last reference is the caller's.
      ended = state_->stuck.empty() &&
              state_->cv.wait_for(lock, bound, [&] { return state_->running != owner && state_->holding != owner; });
      if (!ended && state_->running == owner) {
        std::deque<Job> rest = stick_locked(
            *state_, str_cat("the process group's comm lane is stuck for good: ", state_->running_name, " has run for ",
                             millis(Clock::now() - state_->running_since), " ms (its ", kind,
                             " was destroyed meanwhile); destroy the dp_ddp and dp_fsdp on it and make a new group"));
        for (Job& job : rest) dropped.push_back(std::move(job));
        reason = state_->stuck;
      } else {
        ended = true;
      }
    }
  }
  drop_all(dropped, StatusCode::kState, reason.empty() ? str_cat("its ", kind, " was destroyed") : reason);
  return ended;
}

}  // namespace dparallel::lane
