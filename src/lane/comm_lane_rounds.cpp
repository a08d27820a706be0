// The lane's worker: agreement rounds, the jobs they let run, and the
// shadow jobs of a joined rank (dp_ddp_join).
#include <algorithm>
#include <map>
#include <mutex>
#include <vector>

#include "core/error.h"
#include "distributed/background_calls.h"
#include "lane/comm_lane.h"
#include "lane/round_wire.h"

namespace dparallel::lane {

namespace {

// A round that let nothing run waits this long, doubling up to the cap, for
// this rank's host to issue more before asking the other ranks again.
constexpr auto kFirstBackoff = std::chrono::microseconds(200);
constexpr auto kMaxBackoff = std::chrono::milliseconds(20);

}  // namespace

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
        if (report_field(v, i, 0) != entry.id) continue;
        listed = true;
        const bool pending = report_field(v, i, 4) != 0;
        if (report_field(v, i, 3) == 0 || pending) everyone_joined_and_idle = false;
        // The job another rank runs next, numbered as this rank's next.
        if (pending && !seen && report_field(v, i, 2) == entry.issued) {
          auto item = static_cast<uint32_t>(report_field(v, i, 4) - 1);
          next.item = static_cast<dist::CallItem>(item >> 24);
          next.index = item & 0xffffffu;
          next.iteration = static_cast<uint32_t>(report_field(v, i, 5));
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
  // The call that joins, for messages: dp_ddp_join.
  const std::string call = str_cat(owners.empty() ? "dp_ddp" : owners.front()->owner_kind(), "_join");
  if (!state_->stuck.empty()) fail(StatusCode::kState, call, ": ", state_->stuck);
  for (const auto& owner : owners) {
    auto it = state_->owners.find(owner.get());
    if (it == state_->owners.end())
      fail(StatusCode::kInternal, call, ": a ", owner->owner_kind(), " that is not on the lane");
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
    fail(StatusCode::kTimeout, call, ": no agreement round with the other ranks came within ", millis(bound), " ms");
  }
  if (!state_->stuck.empty()) fail(state_->stuck_code, call, ": ", state_->stuck);
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
      if (report_field(v, i, 0) == entry.id && report_field(v, i, 1) > entry.executed) issued = true;
    }
    if (!issued) missing += str_cat(missing.empty() ? "" : ", ", r);
  }
  return missing;
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
      report.next_item = int64_t{job_tag(entry.id, 0, next).item} + 1;
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
      state.running_kind = it->second.kind;
      state.running_since = Clock::now();
      lock.unlock();
      {
        dist::CallTagScope scope(job_tag(id, job.number, job.spec));
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

}  // namespace dparallel::lane
