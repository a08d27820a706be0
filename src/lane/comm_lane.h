// The one thread that runs every collective of every dp_ddp and dp_fsdp on
// a process group, in an order all ranks agree on whatever order their hosts mark,
// finish or use threads in.
//
// Each dp_ddp and dp_fsdp (an owner, lane_owner.h) issues its jobs in its
// own sequence, the same on every rank: a dp_ddp's bucket reductions in
// index order, then the used map and the ready order, the buffers'
// broadcast before a forward, the agreement check at creation; a dp_fsdp's
// all-gathers and reduce-scatters. The lane pairs jobs by that identity (owner, job number),
// never by arrival: in a round, the ranks all-gather how many jobs each
// owner has issued, and every rank runs, in (owner, job number) order, the
// jobs every rank has issued. Every call a job makes carries its identity
// in the call header, so that two ranks pairing different jobs fail naming
// both.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "distributed/process_group.h"
#include "lane/lane_owner.h"

namespace dparallel::lane {

class CommLane {
 public:
  using Clock = std::chrono::steady_clock;
  static std::shared_ptr<CommLane> for_group(const std::shared_ptr<dist::ProcessGroup>& group);
  // dp_shutdown: ends the worker of every lane with nothing issued, running
  // or shadowed (joins it); the next job starts a new one. A lane at work,
  // or the calling thread's own, keeps its worker.
  static void park_idle_lanes();
  // Numbers every rank must agree on, kept as long as the group: a lane
  // ends when its last owner does, at another moment on each rank, and the
  // next one goes on counting.
  struct Counters {
    uint32_t next_owner = 0;
    uint32_t rounds = 0;
  };
  CommLane(std::shared_ptr<dist::ProcessGroup> group, std::shared_ptr<Counters> counters);
  ~CommLane();
  CommLane(const CommLane&) = delete;
  CommLane& operator=(const CommLane&) = delete;

  // A new owner's number on the lane: the order of creation on this rank,
  // which must be the same on every rank.
  uint32_t attach(const LaneOwner* owner);
  // Issues the owner's next job; it runs once every rank issued it. False
  // when the lane is stuck (stuck_reason()): nothing was issued.
  bool push(const std::shared_ptr<LaneOwner>& owner, JobSpec spec);
  // Issues `fn` as the owner's next job and returns once it ran, rethrowing
  // what it threw. When it has not started within `bound` (a job before it
  // never ends, or the other ranks never issue theirs), kTimeout naming
  // it; on a stuck lane, kState at once.
  void call(const LaneOwner* owner, const JobSpec& spec, const std::function<void()>& fn, Clock::duration bound);
  // Drops the owner's queued jobs and waits up to `bound` for its running
  // one to end, then forgets the owner. False when the job did not end: the
  // lane is then stuck for good.
  bool detach(const LaneOwner* owner, Clock::duration bound);
  // An owner gave up waiting for its jobs: when one is running, the lane
  // is stuck for good (`why` and the running job in the reason), and every
  // queued job is dropped with that reason.
  void give_up(const std::string& why);
  bool on_worker() const { return std::this_thread::get_id() == state_->worker.load(); }
  // The owner's next job (its number) to run, and "ranks 1, 2" that had not
  // issued it in the last agreement round ("" when every rank had, or no
  // round ran since it was issued): for the message of a wait that gave up.
  std::string ranks_missing_next_job(const LaneOwner* owner);
  std::string stuck_reason();
  // What a job of a stuck lane fails with: the failed round's code, else kState.
  StatusCode stuck_code();
  // The owner's backward is in flight (from its first mark to the end of
  // its finish): the host's own calls on the group are refused meanwhile.
  void set_in_backward(const LaneOwner* owner, bool in_backward);
  // dp_ddp_join: from now on this rank shadows the other ranks' jobs of
  // `owner` (issuing each as the round says they issued it) until a round
  // shows every rank joined with nothing pending; returns then. kTimeout
  // when no round came within `bound` of the last; kState on a stuck lane.
  void join(const std::vector<std::shared_ptr<LaneOwner>>& owners, Clock::duration bound);

 private:
  struct Job {
    std::shared_ptr<LaneOwner> owner;  // push()ed jobs: kept alive until run
    JobSpec spec;
    uint32_t number = 0;                                       // the owner's job number
    std::function<void()> run;                                 // call()
    std::function<void()> complete;                            // call(): once the lane is free again
    std::function<void(StatusCode, const std::string&)> drop;  // call(): when the lane drops it unrun
    JobResult result;
    void execute();
    void publish();
    void drop_unrun(StatusCode code, const std::string& why);
  };
  struct Owner {
    uint32_t id = 0;
    const char* kind = "";  // the owner's owner_kind(), for messages
    bool in_backward = false;
    std::shared_ptr<LaneOwner> joined;  // set while shadowing (dp_ddp_join)
    bool join_done = false;             // a round showed every rank joined
    uint32_t issued = 0;                // jobs issued on this rank
    uint32_t executed = 0;              // jobs run (or dropped) in agreement with every rank
    std::deque<Job> jobs;               // issued, not yet run: job numbers executed, executed + 1, ...
  };
  // What the worker thread shares with the lane: it outlives the lane when
  // the worker is stuck in a job that never returns.
  struct State {
    State(std::shared_ptr<dist::ProcessGroup> g, std::shared_ptr<Counters> c)
        : group(std::move(g)), counters(std::move(c)) {}
    std::shared_ptr<dist::ProcessGroup> group;
    std::shared_ptr<Counters> counters;
    std::mutex mutex;
    std::condition_variable cv;
    std::map<const LaneOwner*, Owner> owners;
    uint64_t pushes = 0;  // grows with every job issued: the worker waits for it to change
    const LaneOwner* running = nullptr;
    // The owner whose job the worker holds (running it, or publishing its
    // outcome): its owner must not be released on the worker's thread.
    const LaneOwner* holding = nullptr;
    std::string running_name;
    const char* running_kind = "";  // the running job's owner_kind()
    Clock::time_point running_since;
    std::vector<std::vector<int64_t>> last_counts;  // the last round's reports, per rank
    std::string stuck;                              // why the lane stopped for good
    StatusCode stuck_code = StatusCode::kState;
    bool stopping = false;
    bool parking = false;                   // park_if_idle: the worker ends once idle
    std::atomic<std::thread::id> worker{};  // the running worker's; none while parked
  };
  // Refuses the host's calls on the group while any owner is at work.
  class Gate;
  static void loop(const std::shared_ptr<State>& state);
  // One agreement round and the jobs it lets run; false when it ran none.
  static bool run_round(State& state, std::unique_lock<std::mutex>& lock);
  static std::string job_name(const Job& job);
  static int64_t millis(Clock::duration d) { return std::chrono::duration_cast<std::chrono::milliseconds>(d).count(); }
  static bool has_pending_locked(const State& state);
  // Marks the lane stuck (locked) and returns the jobs to drop.
  static std::deque<Job> stick_locked(State& state, const std::string& why, StatusCode code = StatusCode::kState);
  static void drop_all(std::deque<Job>& jobs, StatusCode code, const std::string& why);

  // The jobs of this round whose owners a joined rank shadows (locked).
  // True when it issued one.
  static bool issue_shadow_jobs_locked(State& state, const std::vector<std::vector<int64_t>>& counts);

  // Starts the worker unless it runs; thread_mutex_ held.
  void start_worker_locked();
  // Ends an idle worker; false when the lane is at work (or this is its worker).
  bool park_if_idle();

  std::shared_ptr<State> state_;
  std::shared_ptr<Gate> gate_;
  // Guards thread_ and, taken before the state's mutex, keeps a job from
  // being issued between a park's idle check and its end.
  std::mutex thread_mutex_;
  std::thread thread_;
};

}  // namespace dparallel::lane
