// What runs on a process group's comm lane (comm_lane.h): the jobs an
// owner (a dp_ddp's reducer, a dp_fsdp's sharding) issues, and how each
// ended.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <new>
#include <string>

#include "core/error.h"
#include "distributed/call_header.h"

namespace dparallel::lane {

// How a job ended: handed to its owner once the lane is free again, so
// that whoever waits for it may use the group as soon as it wakes.
struct JobResult {
  StatusCode code = StatusCode::kOk;
  std::string error;
  std::chrono::steady_clock::time_point start, end;
};

// Runs `body(result)` as a job, timed: whatever it throws becomes the
// result's code and message (nothing leaves the lane's thread).
template <class Body>
JobResult timed_job(Body&& body) {
  JobResult result;
  result.start = std::chrono::steady_clock::now();
  try {
    body(result);
  } catch (const Error& e) {
    result.code = e.code();
    result.error = e.what();
  } catch (const std::bad_alloc&) {
    result.code = StatusCode::kOutOfMemory;
    result.error = "out of memory";
  } catch (const std::exception& e) {
    result.code = StatusCode::kInternal;
    result.error = e.what();
  }
  result.end = std::chrono::steady_clock::now();
  return result;
}

struct JobSpec {
  dist::CallItem item = dist::CallItem::kBucket;
  size_t index = 0;     // the bucket, for kBucket
  std::string refusal;  // nonempty: the job stands in for its collectives and fails them on every rank
  uint32_t iteration = 0;
  bool shadow = false;  // a joined rank's stand-in for the other ranks' job: zeros, nothing kept
};

// What issues jobs on a lane: a dp_ddp's reducer, a dp_fsdp's sharding.
class LaneOwner {
 public:
  virtual ~LaneOwner() = default;
  // For messages: "dp_ddp" or "dp_fsdp".
  virtual const char* owner_kind() const = 0;
  // On the lane's worker: one job (or, with a refusal, its refusal).
  virtual JobResult run_job(const JobSpec& spec) = 0;
  // Once the lane is free again: how the job ended.
  virtual void complete_job(const JobSpec& spec, JobResult result) = 0;
  // The lane dropped a job unrun: it fails with `why`.
  virtual void drop_job(const JobSpec& spec, StatusCode code, const std::string& why) = 0;
  // The ranks still active (not joined) for the job about to run.
  virtual void set_active_ranks(int32_t active) { (void)active; }
};

// What this thread runs inside a lane job: an owner's callback into the
// host (a dp_ddp's comm hook or on_bucket_reduced, `what`), for its bucket,
// or nothing. A call there that waits for the lane would wait for itself.
struct RunningHook {
  const LaneOwner* owner = nullptr;
  size_t bucket = 0;
  const char* what = "comm hook";
};
RunningHook running_hook() noexcept;

// Marks this thread as running `hook` for the scope.
class RunningHookScope {
 public:
  explicit RunningHookScope(RunningHook hook);
  ~RunningHookScope();
  RunningHookScope(const RunningHookScope&) = delete;
  RunningHookScope& operator=(const RunningHookScope&) = delete;
};

}  // namespace dparallel::lane
