#include "fsdp/async_save.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/thread_name.h"
#include "fsdp/save_manifest.h"
#include "fsdp/sharded_save_steps.h"
#include "fsdp/state_dict_entries.h"

namespace dparallel::fsdp {

namespace {

using Clock = std::chrono::steady_clock;
using dist::Bytes;
using dist::Millis;

struct SaveJob {
  std::shared_ptr<dist::Store> store;
  std::string keys;  // the save's own prefix in `store`
  int32_t rank = 0;
  int32_t world = 1;
  Millis timeout{0};
  std::string folder;
  RankFile file;    // the copies
  Outcome refused;  // this rank's refusal, posted as its outcome
  std::shared_ptr<dist::Work> work;
};

Bytes bytes_of(const std::string& text) { return Bytes(text.begin(), text.end()); }
std::string text_of(const Bytes& bytes) { return std::string(bytes.begin(), bytes.end()); }

void write_save(SaveJob& job);

// One group's saves not yet written, in call order; a thread writes them
// while there are some.
struct SaveQueue {
  std::deque<SaveJob> jobs;
  bool writing = false;
};

// Each group's count of saves (the n of its keys, alike on every rank) and
// queue. Saves on different groups are written by threads of their own, so
// that one group's save never waits behind another's (whose peers may be
// writing this one's first). Never destroyed: a save still running at exit
// finds it.
class SaveWriters {
 public:
  static SaveWriters& instance() {
    static SaveWriters* writers = [] {
      auto* w = new SaveWriters();
      // At exit, the running saves stop waiting for their peers and the
      // queued ones fail, before the library's statics go.
      std::atexit([] { instance().stop_for_exit(); });
      return w;
    }();
    return *writers;
  }

  uint64_t next_save_number(const std::shared_ptr<dist::ProcessGroup>& group) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = groups_.begin(); it != groups_.end();) it = it->first.expired() ? groups_.erase(it) : std::next(it);
    return groups_[group].saves++;
  }

  void push(const std::shared_ptr<dist::ProcessGroup>& group, SaveJob job) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::shared_ptr<SaveQueue>& queue = groups_[group].queue;
    if (!queue) queue = std::make_shared<SaveQueue>();
    queue->jobs.push_back(std::move(job));
    if (queue->writing) return;
    try {
      std::thread([this, queue] { write_all(*queue); }).detach();
    } catch (const std::system_error& e) {
      // No thread: the queued saves fail now rather than wait for one.
      for (SaveJob& queued : queue->jobs) {
        queued.work->finish(StatusCode::kInternal,
                            str_cat("the sharded save to '", queued.folder,
                                    "' was not written: no thread to write it (", e.what(), ")"));
      }
      queue->jobs.clear();
      return;
    }
    queue->writing = true;
    ++writing_;
  }

  bool exiting() const { return exiting_.load(); }

 private:
  struct GroupSaves {
    uint64_t saves = 0;
    std::shared_ptr<SaveQueue> queue;  // the writing thread holds it too: it outlives the group
  };

  void write_all(SaveQueue& queue) {
    name_this_thread("dp-save");
    std::unique_lock<std::mutex> lock(mutex_);
    while (!queue.jobs.empty()) {
      SaveJob job = std::move(queue.jobs.front());
      queue.jobs.pop_front();
      lock.unlock();
      if (exiting_) {
        job.work->finish(StatusCode::kState,
                         str_cat("the sharded save to '", job.folder, "' was not written: the process exited first"));
      } else {
        write_save(job);
      }
      job = SaveJob();  // the copies go before the next save's
      lock.lock();
    }
    queue.writing = false;
    --writing_;
    idle_.notify_all();
  }

  void stop_for_exit() {
    exiting_ = true;
    std::unique_lock<std::mutex> lock(mutex_);
    idle_.wait(lock, [&] { return writing_ == 0; });
  }

  std::mutex mutex_;
  std::condition_variable idle_;
  std::map<std::weak_ptr<dist::ProcessGroup>, GroupSaves, std::owner_less<std::weak_ptr<dist::ProcessGroup>>> groups_;
  size_t writing_ = 0;  // threads writing
  std::atomic<bool> exiting_{false};
};

// Waits until every key of `keys` is in the store, up to `deadline`; false
// at the deadline. kState once the process is exiting.
bool wait_for_keys(dist::Store& store, const std::vector<std::string>& keys, Clock::time_point deadline) {
  // A check asks for at most this many keys (the TCP store's limit per request).
  constexpr size_t kKeysPerCheck = 1024;
  size_t present = 0;  // keys[0, present) are known to be there
  auto all_there = [&] {
    for (; present < keys.size(); present = std::min(keys.size(), present + kKeysPerCheck)) {
      const auto from = keys.begin() + static_cast<std::ptrdiff_t>(present);
      const auto to = keys.begin() + static_cast<std::ptrdiff_t>(std::min(keys.size(), present + kKeysPerCheck));
      if (!store.check(std::vector<std::string>(from, to))) return false;
    }
    return true;
  };
  const auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
  if (left.count() <= 0) return all_there();
  dist::ReplyDeadlineCap cap(left);
  try {
    return dist::poll_until(
        [&] {
          if (SaveWriters::instance().exiting()) fail(StatusCode::kState, "the process is exiting");
          return all_there();
        },
        left);
  } catch (const Error& e) {
    if (e.code() != StatusCode::kTimeout) throw;  // a request cut off by the deadline is a plain timeout
    return false;
  }
}

// Sets `key` to `text`, the request ending by `bound` (a store gone does not hold it longer).
void post(dist::Store& store, const std::string& key, const std::string& text, Millis bound) {
  dist::ReplyDeadlineCap cap(bound);
  store.set(key, bytes_of(text));
}

// The ranks whose `name` key is missing ("1, 3"), asking the store briefly.
std::string missing_ranks(dist::Store& store, const std::string& keys, const std::string& name, int32_t world) {
  dist::ReplyDeadlineCap brief(dist::kMissingKeysBound);
  std::string missing;
  for (int32_t r = 0; r < world; ++r) {
    bool present = false;
    try {
      present = store.check({str_cat(keys, name, r)});
    } catch (const Error&) {
    }
    if (!present) missing += str_cat(missing.empty() ? "" : ", ", r);
  }
  return missing;
}

// Rank 0 adds this to a save's "state" key before it writes the manifest,
// and a rank giving up on a save whose file it reported written adds 1:
// whichever comes first decides whether the save is completed or dropped.
constexpr int64_t kCommitMark = int64_t{1} << 40;

void write_save(SaveJob& job) {
  dist::Store& store = *job.store;
  const std::string what = str_cat("the sharded save to '", job.folder, "'");
  const std::string kept = "; nothing of it is kept, and the folder's last complete save is as it was";
  const std::string timeout_text = str_cat(" within the group's timeout (", job.timeout.count(), " ms)");
  std::string file;
  bool wrote_file = false;
  bool reported_file = false;  // this rank told the others its file is written
  bool posted_done = false;
  // Every rank, once it read what it needs: the last one erases the save's
  // keys. Best effort: briefly after a failure (the store may be gone), not
  // at all once the process exits.
  auto leave = [&](Millis bound) {
    if (posted_done || SaveWriters::instance().exiting()) return;
    posted_done = true;
    dist::ReplyDeadlineCap cap(bound);
    std::vector<std::string> keys{job.keys + "id", job.keys + "verdict", job.keys + "state", job.keys + "done"};
    for (int32_t r = 0; r < job.world; ++r) keys.push_back(str_cat(job.keys, "report/", r));
    if (store.add(job.keys + "done", 1) == job.world) dist::forget_keys(store, keys);
  };
  // After a failure: this rank's file goes, unless rank 0 may have made it
  // part of a completed save.
  auto drop_file = [&] {
    if (!wrote_file) return;
    if (reported_file) {
      try {
        dist::ReplyDeadlineCap cap(Millis(1000));
        if (store.add(job.keys + "state", 1) >= kCommitMark) return;  // rank 0 completed it first
      } catch (...) {
        return;  // unknown: the file stays, and the next complete save removes it
      }
    }
    remove_quietly(file);
  };
  const Outcome outcome = [&]() -> Outcome {
    try {
      // Rank 0's id names the save.
      if (job.rank == 0) post(store, job.keys + "id", new_save_id(), job.timeout);
      if (!wait_for_keys(store, {job.keys + "id"}, Clock::now() + job.timeout)) {
        fail(StatusCode::kTimeout, what, " failed: rank 0 did not start it", timeout_text);
      }
      const std::string save_id = text_of(store.get(job.keys + "id", job.timeout));
      if (!is_save_id(save_id)) fail(StatusCode::kRemote, what, " failed: rank 0 posted a malformed save id");
      file = job.folder + "/" + shard_file_name(job.rank, job.world, save_id);
      // This rank's file, under a name of this save's: the last save's files stay.
      std::string report;
      Outcome wrote = job.refused;
      if (wrote.ok()) {
        wrote = [&]() -> Outcome {
          try {
            make_folder(job.folder);
            report = write_rank_file(job.file, job.rank, job.world, save_id, file);
            return {};
          } catch (const Error& e) {
            return {e.code(), e.what()};
          } catch (const std::bad_alloc&) {
            return {StatusCode::kOutOfMemory, "out of memory"};
          }
        }();
        wrote_file = wrote.ok();
      }
      job.file = RankFile();
      post(store, str_cat(job.keys, "report/", job.rank), encode_outcome(wrote, report), job.timeout);
      reported_file = wrote_file;
      // Every rank's report, the lowest failing rank named alike on every rank.
      const Clock::time_point deadline = Clock::now() + job.timeout;
      std::vector<std::string> report_keys;
      report_keys.reserve(static_cast<size_t>(job.world));
      for (int32_t r = 0; r < job.world; ++r) report_keys.push_back(str_cat(job.keys, "report/", r));
      if (!wait_for_keys(store, report_keys, deadline)) {
        fail(StatusCode::kTimeout, what, " failed: rank(s) ", missing_ranks(store, job.keys, "report/", job.world),
             " did not report their file", timeout_text, kept);
      }
      std::vector<std::string> reports;
      reports.reserve(report_keys.size());
      for (const std::string& key : report_keys) reports.push_back(text_of(store.get(key, job.timeout)));
      for (int32_t r = 0; r < job.world; ++r) {
        const Outcome o = decode_outcome(reports[static_cast<size_t>(r)], r);
        if (!o.ok()) fail(o.code, what, " failed on rank ", r, ": ", o.message, kept);
      }
      // Rank 0 writes the manifest last: the save is complete once it is in
      // place. Earlier saves' files go before the verdict, so that none of a
      // next save's can be taken for them.
      if (job.rank == 0) {
        Outcome committed;
        try {
          if (store.add(job.keys + "state", kCommitMark) != kCommitMark) {
            committed = {StatusCode::kTimeout, "a rank gave up waiting for the others before rank 0 could complete it"};
          } else {
            wrote_file = false;  // the save's now, whatever follows
            write_manifest(job.folder, save_id, job.world, reports);
            remove_other_saves(job.folder, save_id);
          }
        } catch (const Error& e) {
          committed = {e.code(), e.what()};
        }
        post(store, job.keys + "verdict", encode_outcome(committed), job.timeout);
      }
      if (!wait_for_keys(store, {job.keys + "verdict"}, deadline)) {
        wrote_file = false;  // whether the manifest is in place is unknown: the files stay, a load checks them
        fail(StatusCode::kTimeout, what, ": the ranks could not learn whether it completed: rank 0 posted no verdict",
             timeout_text);
      }
      const Outcome rank0 = decode_outcome(text_of(store.get(job.keys + "verdict", job.timeout)), 0);
      if (!rank0.ok()) fail(rank0.code, what, " failed on rank 0, writing its manifest: ", rank0.message, kept);
      wrote_file = false;  // complete: the file is the save's
      try {
        leave(job.timeout);
      } catch (const Error&) {
      }
      return {};
    } catch (const Error& e) {
      drop_file();
      try {
        leave(Millis(1000));
      } catch (const Error&) {
      }
      return {e.code(), e.what()};
    } catch (const std::exception& e) {
      drop_file();
      return {StatusCode::kInternal, str_cat(what, " failed: ", e.what())};
    }
  }();
  job.work->finish(outcome.code, outcome.message);
}

}  // namespace

std::shared_ptr<dist::Work> save_sharded_state_dict_async(Module* module,
                                                          const std::shared_ptr<dist::ProcessGroup>& group,
                                                          const std::string& folder, const std::string& refusal) {
  const dist::GroupLineage& lineage = group->lineage();
  SaveJob job;
  job.store = lineage.store;
  job.keys = str_cat(lineage.prefix, "async_save/", SaveWriters::instance().next_save_number(group), "/");
  job.rank = group->rank();
  job.world = group->size();
  job.timeout = group->timeout();
  job.folder = folder;
  job.work = std::make_shared<dist::Work>();
  try {
    if (!refusal.empty()) fail_invalid(refusal);
    const std::vector<Held> state = held_state(*module);
    const std::shared_ptr<FullyShard> holder = check_state_groups(state, *group);
    if (holder && holder->replicate_group()) {
      fail(StatusCode::kUnsupported,
           "a background sharded save of an HSDP module (a dp_fsdp with replicas) is not supported: use "
           "dp_fsdp_save_sharded_state_dict");
    }
    // The copy aside: what the host changes from now on is not the save's.
    job.file = rank_file_of(state, job.rank);
    const Device cpu{DeviceType::kCpu, 0};
    for (StateEntry& e : job.file.entries) e.value = e.value.to(cpu);
  } catch (const Error& e) {
    job.file = RankFile();
    job.refused = {e.code(), e.what()};
  } catch (const std::bad_alloc&) {
    job.file = RankFile();
    job.refused = {StatusCode::kOutOfMemory, "out of memory copying the save aside"};
  }
  const Outcome refused = job.refused;
  std::shared_ptr<dist::Work> work = job.work;
  SaveWriters::instance().push(group, std::move(job));
  if (!refused.ok()) fail(refused.code, refused.message);
  return work;
}

}  // namespace dparallel::fsdp
