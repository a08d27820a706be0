// The flight recorder: every process group keeps its last calls (what,
// how big, in which state, when) in a ring that a failing or signalled
// process writes out as JSON, without taking a lock the failing path may
// hold. `dp-run --diagnose DIR` reads every rank's file and names the rank
// behind and the first call that differs (tools/dp_run_diagnose.cpp).
//
//   DP_TRACE_BUFFER  calls kept per group (default 2000; 0: none kept)
//   DP_TRACE_DIR     where the dumps go: one file per rank, rank<RANK>.json
//                    (pid<pid>.json without RANK), written on a timeout,
//                    an abort, or SIGUSR1 when the host left SIGUSR1's
//                    action at its default
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "distributed/call_header.h"

namespace dparallel::dist {

// One call as the ring holds it (plain data, copied in and out whole).
struct TraceCall {
  enum State : uint32_t { kIssued = 0, kStarted = 1, kDone = 2, kFailed = 3 };
  uint64_t id = 0;   // the call's number among this group's calls on this rank, from 1
  uint64_t seq = 0;  // its collective number (the header's), 0 until started
  uint32_t kind = 0;
  uint32_t state = kIssued;
  int32_t dtype = -1, op = -1, root = -1;
  uint32_t refused = 0;
  int64_t numel = -1;
  CallTag tag;
  int64_t issued_us = 0, started_us = 0, ended_us = 0;  // since the epoch, 0: not yet
};

class FlightRecorder {
 public:
  // `capacity` calls; 0 records nothing.
  FlightRecorder(int32_t rank, int32_t size, std::string backend, size_t capacity);
  FlightRecorder(const FlightRecorder&) = delete;
  FlightRecorder& operator=(const FlightRecorder&) = delete;

  // The group's name on every rank (its keys' prefix in the store).
  void set_group_id(const std::string& id);
  // A call submitted, recorded; its id is 0 when nothing is recorded. The
  // caller keeps the copy and hands it to started and finished, so that
  // recording never reads the ring back.
  TraceCall issued(CallKind kind) noexcept;
  // The call exchanges its header (or is about to).
  void started(TraceCall& call, const CallHeader& header) noexcept;
  void finished(TraceCall& call, bool ok) noexcept;
  // The calls kept, oldest first; an entry being written meanwhile is left out.
  std::vector<TraceCall> snapshot() const;
  std::string group_id() const;
  int32_t rank() const { return rank_; }
  int32_t size() const { return size_; }
  const std::string& backend() const { return backend_; }

 private:
  static constexpr size_t kWords = (sizeof(TraceCall) + 7) / 8;
  // A seqlock per slot: odd `version` while the one writer writes.
  struct Slot {
    std::atomic<uint64_t> version{0};
    std::atomic<uint64_t> words[kWords];
  };
  bool read(const Slot& slot, TraceCall& out) const noexcept;
  void write(Slot& slot, const TraceCall& call) noexcept;
  // Writes `call` back unless later calls took its slot.
  void rewrite(const TraceCall& call) noexcept;

  const int32_t rank_, size_;
  const std::string backend_;
  std::unique_ptr<Slot[]> slots_;
  const size_t capacity_;
  std::atomic<uint64_t> next_id_{0};
  mutable std::mutex id_mutex_;  // group_id_ only; never taken by a dump
  std::string group_id_;
  std::atomic<const char*> published_id_{nullptr};        // what a dump reads
  std::vector<std::unique_ptr<std::string>> id_history_;  // keeps every published id alive
};

// DP_TRACE_BUFFER, read once.
size_t trace_buffer_calls();
// Tracks `recorder` for dumps while it lives (and installs the SIGUSR1
// dumper the first time when DP_TRACE_DIR is set).
void register_recorder(const std::shared_ptr<FlightRecorder>& recorder);
// Writes every tracked group's calls to DP_TRACE_DIR (nothing when unset);
// `reason` says why. Never throws; returns the file written, or "".
std::string dump_traces(const std::string& reason) noexcept;
// The JSON a dump writes, for `recorders` (tests read it back).
std::string traces_json(const std::vector<std::shared_ptr<FlightRecorder>>& recorders, const std::string& reason);

}  // namespace dparallel::dist
