#include "ddp/comm_lane.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <optional>
#include <vector>

#include "core/error.h"
#include "core/stream.h"
#include "core/thread_name.h"
#include "core/thread_pool.h"
#include "ddp/host_values.h"
#include "distributed/background_calls.h"

namespace dparallel::ddp {

namespace {

// A round that let nothing run waits this long, doubling up to the cap, for
// this rank's host to issue more before asking the other ranks again.
constexpr auto kFirstBackoff = std::chrono::microseconds(200);
constexpr auto kMaxBackoff = std::chrono::milliseconds(20);

int64_t millis(CommLane::Clock::duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); }

dist::CallTag tag_of(uint32_t owner_id, uint32_t number, const JobSpec& spec) {
  dist::CallTag tag;
  tag.owner = owner_id + 1;
  tag.job = number;
  tag.iteration = spec.iteration;
  tag.item = static_cast<uint32_t>(spec.item) << 24 | static_cast<uint32_t>(spec.index & 0xffffffu);
  return tag;
}

// What a rank says of one owner in a round.
struct OwnerReport {
  uint32_t id = 0;
  uint32_t issued = 0;    // jobs issued
  uint32_t executed = 0;  // jobs run: its next job's number
  bool joined = false;    // dp_ddp_join: this rank shadows the others' jobs
  int64_t next_item = 0;  // the next job's CallTag item + 1, 0 when none is pending
  uint32_t next_iteration = 0;
};
constexpr size_t kFields = 6;

int64_t field(const std::vector<int64_t>& v, size_t owner, size_t f) { return v[1 + kFields * owner + f]; }

// Every rank's owner reports, all-gathered: one int64 vector per rank,
// [count, then kFields values per owner].
std::vector<std::vector<int64_t>> exchange_counts(dist::ProcessGroup& group, uint32_t round,
                                                  const std::vector<OwnerReport>& mine) {
  std::vector<int64_t> values(1 + kFields * CommLane::kOwnersPerRound, 0);
  values[0] = static_cast<int64_t>(mine.size());
  for (size_t i = 0; i < mine.size(); ++i) {
    int64_t* at = &values[1 + kFields * i];
    at[0] = mine[i].id;
    at[1] = mine[i].issued;
    at[2] = mine[i].executed;
    at[3] = mine[i].joined ? 1 : 0;
    at[4] = mine[i].next_item;
    at[5] = mine[i].next_iteration;
  }
  if (group.size() == 1) return {values};
  dist::CallTag tag;
  tag.owner = dist::kLaneRoundOwner;
  tag.job = round;
  dist::CallTagScope scope(tag);
  const Device device = group.device();
  // Where the group has a control stream (NCCL), the round's copies and
  // allocations go there too: the library stream may wait for a host's
  // stream (any call made with a current stream set), and a round must not.
  // Opened before the tensors, so that their frees follow that stream.
  std::optional<LibraryWorkStaysQueued> staging;
  if (void* control = group.control_stream()) staging.emplace(device, control);
  std::vector<Tensor> all = gather_outputs(group.size(), DType::kInt64, static_cast<int64_t>(values.size()), device);
  group.all_gather(to_device(host_int64(values), device), all, false);
  std::vector<std::vector<int64_t>> counts;
  counts.reserve(all.size());
  for (const Tensor& t : all) counts.push_back(read_int64(t));
  return counts;
}

// For each owner every rank listed: how many of its jobs every rank issued.
std::map<uint32_t, uint32_t> agreed_counts(const std::vector<std::vector<int64_t>>& counts) {
  std::map<uint32_t, uint32_t> agreed;
  for (size_t r = 0; r < counts.size(); ++r) {
    const std::vector<int64_t>& v = counts[r];
    if (v.empty() || v[0] < 0 || v[0] > static_cast<int64_t>(CommLane::kOwnersPerRound)) {
      fail(StatusCode::kRemote, "rank ", r, " sent a malformed agreement round");
    }
    if (v.size() != 1 + kFields * CommLane::kOwnersPerRound) {
      fail(StatusCode::kRemote, "rank ", r, " sent a malformed agreement round");
    }
    std::map<uint32_t, uint32_t> theirs;
    for (size_t i = 0; i < static_cast<size_t>(v[0]); ++i) {
      int64_t owner = field(v, i, 0);
      int64_t issued = field(v, i, 1);
      int64_t executed = field(v, i, 2);
      int64_t next_item = field(v, i, 4);
      if (owner < 0 || owner > UINT32_MAX || issued < 0 || issued > UINT32_MAX || executed < 0 || executed > issued ||
          next_item < 0 || next_item > UINT32_MAX + int64_t{1} || field(v, i, 5) < 0 || field(v, i, 5) > UINT32_MAX) {
        fail(StatusCode::kRemote, "rank ", r, " sent a malformed agreement round");
      }
      theirs[static_cast<uint32_t>(owner)] = static_cast<uint32_t>(issued);
    }
    if (r == 0) {
      agreed = std::move(theirs);
      continue;
    }
    for (auto it = agreed.begin(); it != agreed.end();) {
      auto found = theirs.find(it->first);
      if (found == theirs.end()) {
        it = agreed.erase(it);
        continue;
      }
      it->second = std::min(it->second, found->second);
      ++it;
    }
  }
  return agreed;
}

// For each owner: how many ranks report it joined.
std::map<uint32_t, int32_t> joined_counts(const std::vector<std::vector<int64_t>>& counts) {
  std::map<uint32_t, int32_t> joined;
  for (const auto& v : counts) {
    for (size_t i = 0; i < static_cast<size_t>(v[0]); ++i) {
      if (field(v, i, 3) != 0) ++joined[static_cast<uint32_t>(field(v, i, 0))];
    }
  }
  return joined;
}

}  // namespace

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
      return str_cat(entry.kind, " #", entry.id,
                     " on this group is in a backward (from its first mark to the end of dp_ddp_finish_backward) "
                     "or has collectives queued; a collective of the host's now would pair with a dp_ddp's on some "
                     "rank: make it before the first mark or after every dp_ddp_finish_backward");
    }
    if (state_->running != nullptr) {
      return str_cat("a dp_ddp on this group runs ", state_->running_name, "; call once it ended");
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
    // issuing the next job (holding its reducer's lock) is never held up.
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
  // A worker stuck in a job (or this very thread, when the job's reducer
  // was the last owner) ends on its own; the state lives as long as it.
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

bool CommLane::has_pending_locked(const State& state) {
  return std::any_of(state.owners.begin(), state.owners.end(),
                     [](const auto& o) { return !o.second.jobs.empty() || (o.second.joined && !o.second.join_done); });
}

bool CommLane::issue_shadow_jobs_locked(State& state, const std::vector<std::vector<int64_t>>& counts) {
  bool issued = false;
  for (auto& [owner, entry] : state.owners) {
    if (!entry.joined || entry.join_done) continue;
    bool everyone_joined_and_idle = entry.jobs.empty();
    bool seen = false;
    JobSpec next;
    for (const auto& v : counts) {
      bool listed = false;
      for (size_t i = 0; i < static_cast<size_t>(v[0]); ++i) {
        if (field(v, i, 0) != entry.id) continue;
        listed = true;
        const bool pending = field(v, i, 4) != 0;
        if (field(v, i, 3) == 0 || pending) everyone_joined_and_idle = false;
        // The job another rank runs next, numbered as this rank's next.
        if (pending && !seen && field(v, i, 2) == entry.issued) {
          auto item = static_cast<uint32_t>(field(v, i, 4) - 1);
          next.item = static_cast<dist::CallItem>(item >> 24);
          next.index = item & 0xffffffu;
          next.iteration = static_cast<uint32_t>(field(v, i, 5));
          next.shadow = true;
          seen = true;
        }
      }
      if (!listed) everyone_joined_and_idle = false;
    }
    if (everyone_joined_and_idle) {
      entry.join_done = true;
      state.cv.notify_all();
      continue;
    }
    if (!seen) continue;
    Job job;
    job.owner = entry.joined;
    job.spec = next;
    job.number = entry.issued++;
    entry.jobs.push_back(std::move(job));
    issued = true;
  }
  return issued;
}

void CommLane::join(const std::vector<std::shared_ptr<LaneOwner>>& owners, Clock::duration bound) {
  std::unique_lock<std::mutex> threads(thread_mutex_);
  start_worker_locked();
  std::unique_lock<std::mutex> lock(state_->mutex);
  if (!state_->stuck.empty()) fail(StatusCode::kState, "dp_ddp_join: ", state_->stuck);
  for (const auto& owner : owners) {
    auto it = state_->owners.find(owner.get());
    if (it == state_->owners.end()) fail(StatusCode::kInternal, "dp_ddp_join: a dp_ddp that is not on the lane");
    it->second.joined = owner;
    it->second.join_done = false;
  }
  ++state_->pushes;
  state_->cv.notify_all();
  threads.unlock();  // shadowing: the worker cannot park
  auto done = [&] {
    if (!state_->stuck.empty()) return true;
    for (const auto& owner : owners) {
      auto it = state_->owners.find(owner.get());
      if (it != state_->owners.end() && !it->second.join_done) return false;
    }
    return true;
  };
  // Each round is bounded by the group's timeout; `bound` covers one more.
  bool timed_out = false;
  uint32_t rounds_seen = state_->counters->rounds;
  dist::BackgroundCalls::Awaited awaited;
  while (!done() && !timed_out) {
    timed_out = !state_->cv.wait_for(lock, bound, done) && state_->counters->rounds == rounds_seen;
    rounds_seen = state_->counters->rounds;
  }
  for (const auto& owner : owners) {
    auto it = state_->owners.find(owner.get());
    if (it != state_->owners.end()) it->second.joined.reset();
  }
  if (timed_out) {
    fail(StatusCode::kTimeout, "dp_ddp_join: no agreement round with the other ranks came within ", millis(bound),
         " ms");
  }
  if (!state_->stuck.empty()) fail(state_->stuck_code, "dp_ddp_join: ", state_->stuck);
}

std::string CommLane::ranks_missing_next_job(const LaneOwner* owner) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  auto it = state_->owners.find(owner);
  if (it == state_->owners.end() || it->second.jobs.empty()) return "";
  const Owner& entry = it->second;
  std::string missing;
  for (size_t r = 0; r < state_->last_counts.size(); ++r) {
    const std::vector<int64_t>& v = state_->last_counts[r];
    bool issued = false;
    for (size_t i = 0; !v.empty() && i < static_cast<size_t>(v[0]); ++i) {
      if (field(v, i, 0) == entry.id && field(v, i, 1) > entry.executed) issued = true;
    }
    if (!issued) missing += str_cat(missing.empty() ? "" : ", ", r);
  }
  return missing;
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
  {
    std::unique_lock<std::mutex> lock(state_->mutex);
    auto it = state_->owners.find(owner);
    if (it != state_->owners.end()) {
      for (Job& job : it->second.jobs) dropped.push_back(std::move(job));
      state_->owners.erase(it);
    }
    if (!on_worker() && (state_->running == owner || state_->holding == owner)) {
      // Also past the running job's end: the worker lets go of the reducer
      // before this returns, so that its last reference is the caller's.
      ended = state_->stuck.empty() &&
              state_->cv.wait_for(lock, bound, [&] { return state_->running != owner && state_->holding != owner; });
      if (!ended && state_->running == owner) {
        std::deque<Job> rest = stick_locked(
            *state_,
            str_cat(
                "the process group's comm lane is stuck for good: ", state_->running_name, " has run for ",
                millis(Clock::now() - state_->running_since),
                " ms (its dp_ddp was destroyed meanwhile); destroy the dp_ddp and dp_fsdp on it and make a new group"));
        for (Job& job : rest) dropped.push_back(std::move(job));
        reason = state_->stuck;
      } else {
        ended = true;
      }
    }
  }
  drop_all(dropped, StatusCode::kState, reason.empty() ? std::string("its dp_ddp was destroyed") : reason);
  return ended;
}

bool CommLane::run_round(State& state, std::unique_lock<std::mutex>& lock) {
  std::vector<OwnerReport> mine;
  for (const auto& [owner, entry] : state.owners) {
    const bool shadowing = entry.joined && !entry.join_done;
    if (entry.jobs.empty() && !shadowing) continue;
    OwnerReport report;
    report.id = entry.id;
    report.issued = entry.issued;
    report.executed = entry.executed;
    report.joined = shadowing;
    if (!entry.jobs.empty()) {
      const JobSpec& next = entry.jobs.front().spec;
      report.next_item = int64_t{tag_of(entry.id, 0, next).item} + 1;
      report.next_iteration = next.iteration;
    }
    mine.push_back(report);
  }
  std::sort(mine.begin(), mine.end(), [](const OwnerReport& a, const OwnerReport& b) { return a.id < b.id; });
  if (mine.size() > kOwnersPerRound) mine.resize(kOwnersPerRound);
  const uint32_t round = ++state.counters->rounds;
  std::shared_ptr<dist::ProcessGroup> group = state.group;
  lock.unlock();
  // A host call that began before the jobs were issued ends first; later
  // ones are refused while the jobs wait.
  group->wait_for_other_threads_calls();
  std::map<uint32_t, uint32_t> agreed;
  std::map<uint32_t, int32_t> joined;
  std::vector<std::vector<int64_t>> counts;
  std::string failure;
  StatusCode code = StatusCode::kInternal;
  try {
    counts = exchange_counts(*group, round, mine);
    agreed = agreed_counts(counts);
    joined = joined_counts(counts);
  } catch (const Error& e) {
    failure = e.what();
    code = e.code();
  } catch (const std::exception& e) {
    failure = e.what();
  }
  lock.lock();
  if (!failure.empty()) {
    std::deque<Job> dropped =
        stick_locked(state,
                     str_cat("the process group's comm lane stopped: its agreement round #", round,
                             " failed: ", failure, "; destroy the dp_ddp and dp_fsdp on it and make a new group"),
                     code);
    std::string reason = state.stuck;
    lock.unlock();
    drop_all(dropped, code, reason);
    lock.lock();
    return false;
  }
  state.last_counts = counts;
  // Issuing a shadow job counts as progress: the next round runs it.
  bool ran = issue_shadow_jobs_locked(state, counts);
  // Every rank runs the same jobs in the same order: by owner, then number.
  for (const auto& [id, count] : agreed) {
    const int32_t active = group->size() - (joined.count(id) != 0 ? joined[id] : 0);
    for (;;) {
      if (!state.stuck.empty()) return ran;
      auto it = std::find_if(state.owners.begin(), state.owners.end(),
                             [id = id](const auto& o) { return o.second.id == id; });
      if (it == state.owners.end() || it->second.executed >= count || it->second.jobs.empty()) break;
      Job job = std::move(it->second.jobs.front());
      it->second.jobs.pop_front();
      ++it->second.executed;
      state.running = it->first;
      state.holding = it->first;
      state.running_name = job_name(job);
      state.running_since = Clock::now();
      lock.unlock();
      {
        dist::CallTagScope scope(tag_of(id, job.number, job.spec));
        if (job.owner) job.owner->set_active_ranks(active);
        job.execute();
      }
      lock.lock();
      state.running = nullptr;
      state.cv.notify_all();
      lock.unlock();
      job.publish();
      job = Job{};  // releases what the job kept alive, before the lock
      lock.lock();
      state.holding = nullptr;
      state.cv.notify_all();
      ran = true;
    }
  }
  return ran;
}

void CommLane::loop(const std::shared_ptr<State>& state) {
  std::unique_lock<std::mutex> lock(state->mutex);
  auto backoff = std::chrono::duration_cast<Clock::duration>(kFirstBackoff);
  for (;;) {
    state->cv.wait(
        lock, [&] { return state->stopping || state->parking || !state->stuck.empty() || has_pending_locked(*state); });
    // Stuck, stopping (every owner is gone), or parked while idle.
    if (!state->stuck.empty() || !has_pending_locked(*state)) return;
    const uint64_t pushes_seen = state->pushes;
    if (run_round(*state, lock)) {
      backoff = std::chrono::duration_cast<Clock::duration>(kFirstBackoff);
      continue;
    }
    // No job was issued by every rank yet: wait for this rank's host to
    // issue more (another rank waits for it in the next round).
    state->cv.wait_for(lock, backoff,
                       [&] { return state->pushes != pushes_seen || state->stopping || !state->stuck.empty(); });
    backoff = std::min<Clock::duration>(backoff * 2, kMaxBackoff);
  }
}

}  // namespace dparallel::ddp
