// A process group's backend: the engine that moves a collective's bytes.
// The front (process_group.h) owns one and does everything else: argument
// checks, ordering, Work, the broken state, one thread per group. A backend
// sees the front only through CallSite: the steps every collective shares
// (its number and deadline, the header exchange and its verdict, failure
// reports that name the missing ranks).
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "distributed/call_header.h"
#include "distributed/collective.h"
#include "distributed/group_options.h"
#include "distributed/store/store.h"

namespace dparallel::dist {

// While it lives on this thread, the collectives it runs on a backend with
// a transfer stream of its own (NCCL; `transfer_stream`, null for others)
// return once queued on that stream, and the library's own work on
// `device` goes to that stream too and stays queued (LibraryWorkStaysQueued),
// so a job's copies, casts and collectives run in order there without the
// thread waiting for any of them. Whoever uses the results follows that
// stream through an event recorded after them. A queued collective that
// fails later (a peer gone, its deadline passed) aborts the communicator
// and breaks the group, so the next call reports it. The dp_fsdp lane jobs
// open it.
class QueuedTransfers {
 public:
  QueuedTransfers(const Device& device, void* transfer_stream);
  QueuedTransfers(const QueuedTransfers&) = delete;
  QueuedTransfers& operator=(const QueuedTransfers&) = delete;
  // Whether one that queues is open on this thread.
  static bool active();

 private:
  std::optional<LibraryWorkStaysQueued> library_;  // what it is, where it queues
};

// One collective as the front tracks it for every backend.
struct Call {
  CallHeader header;
  std::chrono::steady_clock::time_point deadline;
  bool exchanged = false;          // every rank's header has arrived
  const Tensor* tensor = nullptr;  // named in failures (the first of `pieces`); null for none
  size_t pieces = 1;               // tensors reduced as one (coalesced)
};

// The front's side of the collective a backend runs.
class CallSite {
 public:
  int32_t rank() const { return rank_; }
  int32_t size() const { return world_size_; }
  const Device& device() const { return device_; }
  Millis timeout() const { return timeout_; }

  // Collective #n+1 of this group: its header and deadline. What it may need
  // must be allocated before: failing after the header exchange would leave
  // the peers waiting.
  virtual Call begin_call(CallKind kind, DType dtype, int64_t numel, ReduceOp op, int32_t root,
                          const Tensor* tensor) = 0;
  // Swaps `call`'s header with every rank (the backend's swap_headers) and
  // reaches the verdict every rank reaches (check_call_headers); a verdict
  // that fails calls the backend's after_failed_verdict() first.
  virtual void exchange_headers(Call& call) = 0;
  // Scratch for a collective could not be allocated before its header
  // exchange: refuses the call in its place (the other ranks fail too and the
  // group stays in step); returns the kOutOfMemory error naming `op` and
  // `reason` to throw.
  virtual Error refuse_out_of_memory(CallKind kind, const char* op, const std::string& reason) = 0;
  // A collective whose transfer failed (`code`: kTimeout, kRemote, or
  // kOutOfMemory): reports the failure through the store, then returns the
  // `code` error to throw, naming the collective, its tensor, the ranks that
  // did not report the failure, and `cause`.
  virtual Error call_failed(const Call& call, StatusCode code, const std::string& cause) = 0;
  // As call_failed, when this rank already knows who is missing (`missing`,
  // e.g. peers whose processes it saw exit): no listening for reports.
  virtual Error call_failed_knowing(const Call& call, StatusCode code, const std::string& missing,
                                    const std::string& cause) = 0;
  // Where failure reports go (find_missing_ranks); set by the backend's constructor.
  virtual void set_failure_reports(std::shared_ptr<Store> store, std::string prefix) = 0;
  // True once a collective has failed with kTimeout, kRemote or kInternal.
  virtual bool broken() = 0;
  // Marks the group unusable: a failure that left the ranks out of step.
  virtual void mark_broken(const std::string& why) noexcept = 0;

 protected:
  CallSite(int32_t rank, int32_t world_size, Device device, Millis timeout)
      : rank_(rank), world_size_(world_size), device_(device), timeout_(timeout) {}
  ~CallSite() = default;

 private:
  int32_t rank_;
  int32_t world_size_;
  Device device_;
  Millis timeout_;
};

// Memory every rank of a group maps (RegionService::create_region): this
// rank's part, which collectives on tensors inside it can read from the
// other ranks' parts directly instead of through staging copies.
class SharedRegion {
 public:
  virtual ~SharedRegion() = default;
  virtual uint8_t* data() const = 0;
  virtual size_t bytes() const = 0;
  // Every rank's part, back to back in this process: rank r's is at
  // all_parts() + r * bytes().
  virtual uint8_t* all_parts() const = 0;
};

// Shared regions, a service a backend offers beside its collectives
// (Backend::regions(); capabilities().shared_regions says it does), as
// symmetric memory stands apart from the backends that move bytes.
class RegionService {
 public:
  // A collective of the group: every rank gets `bytes` of memory that the
  // other ranks map too. Tensors inside it may outlive the group.
  virtual std::shared_ptr<SharedRegion> create_region(size_t bytes) = 0;

 protected:
  RegionService() = default;
  ~RegionService() = default;
  RegionService(const RegionService&) = default;
  RegionService& operator=(const RegionService&) = default;
};

// A run of a rank's all-gather segment: bytes [offset, offset +
// view.nbytes()) of the segment are `view`'s bytes.
struct SegmentRun {
  size_t offset = 0;
  Tensor view;
};

// How a backend's collectives run on this thread while the caller waits.
enum class ThreadModel : int32_t {
  // Every collective finishes on the calling thread before it returns.
  kCallerWaits,
  // Inside QueuedTransfers on the backend's transfer stream, a collective
  // returns once queued there; a watch thread of the backend sees it end.
  kQueuesOnStream,
};

// What a backend offers beyond the collectives every backend runs; callers
// ask this rather than the backend's name.
struct BackendCapabilities {
  // Memory every rank maps (Backend::regions()); collectives on tensors
  // inside it read the other ranks' parts directly.
  bool shared_regions = false;
  // all_gather_runs and reduce_scatter_runs read and write the runs where
  // they lie, without a contiguous scratch.
  bool in_place_runs = false;
  // The transfers are memory copies by this process's own cores (no NIC or
  // device does them), so overlapping them with compute gains nothing.
  bool transfers_on_host_cores = false;
  // A stream of its own for transfers (transfer_stream()).
  bool transfer_stream = false;
  // A stream of its own for control calls apart from the transfers
  // (control_stream()).
  bool control_stream = false;
  // The device type its tensors must live on.
  DeviceType tensor_device = DeviceType::kCpu;
  ThreadModel threads = ThreadModel::kCallerWaits;
};

class Backend {
 public:
  explicit Backend(CallSite& site) : site_(site) {}
  virtual ~Backend() = default;
  Backend(const Backend&) = delete;
  Backend& operator=(const Backend&) = delete;

  virtual const char* name() const = 0;
  virtual BackendCapabilities capabilities() const = 0;
  // The device type this backend's tensors must live on.
  DeviceType tensor_device_type() const { return capabilities().tensor_device; }
  // The stream of the group's device its transfers run on, where it has one
  // of its own (NCCL); a call's stream order makes it wait for the host's.
  virtual void* transfer_stream() const { return nullptr; }
  // The stream of the group's device its control calls (call headers, the
  // lane's agreement rounds) run on, where it has one apart from
  // transfer_stream (NCCL with more than one rank); null otherwise.
  virtual void* control_stream() const { return nullptr; }
  // After the front marked the group broken: makes the peers' current or
  // next collective fail now rather than at their timeout.
  virtual void abort(const std::string& /*why*/) noexcept {}

  // Whether a split's new group of `backend` on `device` can be made from
  // this backend's own connections (ProcessGroupOptions::split; the
  // backend's factory then makes it so), and this rank's part of that when
  // it joins no new group: collective over every rank, who agree first.
  virtual bool splits_into(BackendChoice /*backend*/, const Device& /*device*/) const { return false; }
  virtual void split_without_color(std::chrono::steady_clock::time_point /*deadline*/) {}

  // Moves `call.header` to every rank; afterwards received_header(r) is
  // rank r's. A transfer that fails throws CallSite::call_failed.
  virtual void swap_headers(Call& call) = 0;
  virtual CallHeader received_header(int32_t r) = 0;
  // After headers were swapped whose verdict failed (every rank fails alike).
  virtual void after_failed_verdict() {}

  // The collectives, on arguments the front checked.
  virtual void all_reduce(const Tensor& tensor, ReduceOp op) = 0;
  // Default: copies the pieces into one scratch tensor, all-reduces it, copies back.
  virtual void all_reduce_coalesced(const std::vector<Tensor>& tensors, ReduceOp op);
  virtual void broadcast(const Tensor& tensor, int32_t root) = 0;
  virtual void all_gather(const Tensor& input, const std::vector<Tensor>& outputs) = 0;
  // An all_gather of `segment` bytes per rank, the same call as a plain
  // all_gather of that many uint8: this rank's bytes are read from
  // `sources`, rank q's land in `places[q]`; bytes no run covers are
  // neither read nor written. Default: through a contiguous scratch.
  virtual void all_gather_runs(size_t segment, const std::vector<SegmentRun>& sources,
                               const std::vector<std::vector<SegmentRun>>& places);
  virtual void reduce_scatter(const std::vector<Tensor>& inputs, const Tensor& output, ReduceOp op) = 0;
  // A reduce_scatter into `output`, the same call as a plain one: rank q's
  // part (output's size) is read from the runs of `parts[q]` (byte offsets
  // into that part, in order, not overlapping, views of output's dtype);
  // bytes no run covers count as zeros. With `accumulate`, the result is
  // added to what `output` holds. Default: through a contiguous zero-filled
  // scratch.
  virtual void reduce_scatter_runs(const std::vector<std::vector<SegmentRun>>& parts, const Tensor& output, ReduceOp op,
                                   bool accumulate);
  virtual void barrier() = 0;
  // Its shared regions, or null where it has none.
  virtual RegionService* regions() { return nullptr; }

 protected:
  int32_t rank() const { return site_.rank(); }
  int32_t size() const { return site_.size(); }
  const Device& device() const { return site_.device(); }
  Millis timeout() const { return site_.timeout(); }
  Call begin_call(CallKind kind, DType dtype, int64_t numel, ReduceOp op, int32_t root, const Tensor* tensor) {
    return site_.begin_call(kind, dtype, numel, op, root, tensor);
  }
  void exchange_headers(Call& call) { site_.exchange_headers(call); }
  // CallSite's errors, thrown.
  [[noreturn]] void refuse_out_of_memory(CallKind kind, const char* op, const std::string& reason) {
    throw site_.refuse_out_of_memory(kind, op, reason);
  }
  [[noreturn]] void fail_call(const Call& call, StatusCode code, const std::string& cause) {
    throw site_.call_failed(call, code, cause);
  }
  [[noreturn]] void fail_call_knowing(const Call& call, StatusCode code, const std::string& missing,
                                      const std::string& cause) {
    throw site_.call_failed_knowing(call, code, missing, cause);
  }
  void set_failure_reports(std::shared_ptr<Store> store, std::string prefix) {
    site_.set_failure_reports(std::move(store), std::move(prefix));
  }
  bool broken() { return site_.broken(); }
  void mark_broken(const std::string& why) noexcept { site_.mark_broken(why); }
  // A namespace of its own in `store` for a new group of `family` ("pg",
  // "cpu"): "dp/<family><n>/", n counting this rank's groups of the family,
  // so that every rank's n-th group gets the same one. Failure reports go
  // under it.
  std::string claim_key_prefix(const std::shared_ptr<Store>& store, const char* family);

 private:
  CallSite& site_;
};

// The key prefix claim_key_prefix gives, for code that chooses a backend before one exists.
std::string next_group_prefix(Store& store, const char* family, int32_t rank);

// What describes `call` in messages: its tensor, or "no tensor", "a refused call".
std::string describe_call(const Call& call);

// After a failed collective #seq whose deadline is `deadline`: reports this
// rank's failure through the store under `prefix` and names the ranks that
// reported none for it. The others fail soon too, so it listens briefly: under
// a second past the deadline, at most 2 s when it failed early.
std::string find_missing_ranks(Store& store, const std::string& prefix, int32_t rank, int32_t size, uint64_t seq,
                               bool exchanged, std::chrono::steady_clock::time_point deadline);

// Time left until `deadline`, at least 1 ms.
inline Millis left_until(std::chrono::steady_clock::time_point deadline) {
  return std::max(std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now()), Millis(1));
}

// memcpy that takes the null data of empty tensors.
inline void copy_bytes(void* to, const void* from, size_t bytes) {
  if (bytes > 0) std::memcpy(to, from, bytes);
}

// Each backend's factory; the NCCL one fails with kUnsupported in a build without NCCL.
std::unique_ptr<Backend> create_gloo_backend(CallSite& site, const ProcessGroupOptions& options);
std::unique_ptr<Backend> create_nccl_backend(CallSite& site, const ProcessGroupOptions& options);
// Loads the site's MPI library on first use (mpi/mpi_library.h).
std::unique_ptr<Backend> create_mpi_backend(CallSite& site, const ProcessGroupOptions& options);

}  // namespace dparallel::dist
