#include "distributed/process_group.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <iterator>
#include <limits>
#include <thread>
#include <vector>

#include "comm/comm.h"
#include "core/error.h"
#include "distributed/backend_choice.h"
#include "distributed/background_calls.h"
#include "distributed/call_header.h"

namespace dparallel::dist {

const char* reduce_op_name(ReduceOp op) {
  const auto code = static_cast<size_t>(op);
  return code < std::size(kReduceOps) ? kReduceOps[code].name : "unknown";
}

ReduceOp reduce_op_arg(int32_t code, const char* argument) {
  const auto count = static_cast<int32_t>(std::size(kReduceOps));
  if (code < 0 || code >= count) {
    std::string names;
    for (int32_t i = 0; i < count; ++i)
      names += str_cat(i == 0 ? "" : i + 1 == count ? " or " : ", ", kReduceOps[i].c_name);
    fail_invalid("argument '", argument, "' is ", code, "; it must be ", names, " (0..", count - 1, ")");
  }
  return static_cast<ReduceOp>(code);
}

namespace {
// How long a failed rank listens for the others' failure reports: until none is
// new for the quiet time (kReportQuiet, or half the window when that is
// longer), until kReportLimit past the deadline, or kReportLimit when it failed
// late, and never past kEarlyLimit; no request starts in the last kLastRequest.
// A rank that fails early has time to spare: the others, woken by its closed
// connections, may take a while to report on a loaded machine.
constexpr Millis kReportQuiet{250};
constexpr Millis kReportLimit{500};
constexpr Millis kEarlyLimit{2000};
constexpr Millis kLastRequest{100};
}  // namespace

std::string find_missing_ranks(Store& store, const std::string& prefix, int32_t rank, int32_t size, uint64_t seq,
                               bool exchanged, std::chrono::steady_clock::time_point deadline) {
  using Clock = std::chrono::steady_clock;
  auto start = Clock::now();
  auto hard_end = std::max(start + kReportLimit, std::min(start + kEarlyLimit, deadline + kReportLimit));
  Millis quiet = std::max(kReportQuiet, std::chrono::duration_cast<Millis>(hard_end - start) / 2);
  auto quiet_end = start + quiet;
  auto left = [&] { return std::max(std::chrono::duration_cast<Millis>(hard_end - Clock::now()), Millis(1)); };
  std::string base = str_cat(prefix, "failed/", seq, "/");
  std::vector<bool> reported(static_cast<size_t>(size), false);
  reported[static_cast<size_t>(rank)] = true;
  try {
    ReplyDeadlineCap cap(left());
    store.set(base + std::to_string(rank), Bytes{1});
  } catch (const std::exception& e) {
    return str_cat(
        "the store is unreachable too, so the missing ranks are unknown (rank 0 serves it: it may have "
        "exited): ",
        e.what());
  }
  auto pause = std::chrono::milliseconds(1);
  bool store_gone = false;
  for (;;) {
    int32_t missing = 0;
    for (int32_t r = 0; r < size && !store_gone; ++r) {
      if (reported[r]) continue;
      // A request cut off by its deadline would cost the store connection.
      if (hard_end - Clock::now() < kLastRequest) break;
      try {
        ReplyDeadlineCap cap(left());
        reported[r] = store.check({base + std::to_string(r)});
      } catch (const Error&) {
        store_gone = true;  // rank 0 may be done and gone: report what is known
      }
      if (reported[r]) quiet_end = Clock::now() + quiet;
      missing += reported[r] ? 0 : 1;
    }
    auto now = Clock::now();
    if (missing == 0 || store_gone || now >= quiet_end || now >= hard_end - kLastRequest) break;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(20));
  }
  std::string missing;
  for (int32_t r = 0; r < size; ++r) {
    if (!reported[r]) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
  }
  if (missing.empty()) return "every rank reached it and failed";
  if (exchanged) {
    return str_cat("rank(s) ", missing, " did not report this failure within ",
                   std::chrono::duration_cast<Millis>(Clock::now() - start).count(),
                   " ms (exited or stopped, or still blocked in the transfer)");
  }
  return "rank(s) " + missing + " did not arrive (exited, stopped, or in another call)";
}

Call ProcessGroup::begin_call(CallKind kind, DType dtype, int64_t numel, ReduceOp op, int32_t root,
                              const Tensor* tensor) {
  Call call;
  call.header = make_call_header(kind, rank(), ++seq_, dtype, numel, op, root);
  call.deadline = Clock::now() + timeout();
  call.tensor = tensor;
  if (TraceCall* trace = running_call_.load(std::memory_order_relaxed)) recorder_->started(*trace, call.header);
  return call;
}

void ProcessGroup::exchange_headers(Call& call) {
  backend_->swap_headers(call);
  call.exchanged = true;
  try {
    check_call_headers(call.header, rank(), size(), [&](int32_t r) { return backend_->received_header(r); });
  } catch (...) {
    backend_->after_failed_verdict();
    throw;
  }
}

void ProcessGroup::run_refused(CallKind kind, const std::string& reason) {
  Call call;
  call.header = refused_call_header(kind, rank(), ++seq_, reason);
  call.deadline = Clock::now() + timeout();
  if (TraceCall* trace = running_call_.load(std::memory_order_relaxed)) recorder_->started(*trace, call.header);
  exchange_headers(call);
  fail(StatusCode::kInternal, call_kind_name(call.header.kind), ": the header exchange of a refused call passed");
}

Error ProcessGroup::refuse_out_of_memory(CallKind kind, const char* op, const std::string& reason) {
  try {
    run_refused(kind, reason);
  } catch (const Error&) {
    // The verdict; this rank reports its own reason below.
  }
  return Error(StatusCode::kOutOfMemory, str_cat(op, ": ", reason, " (the other ranks' matching call fails too)"));
}

void ProcessGroup::set_failure_reports(std::shared_ptr<Store> store, std::string prefix) {
  report_store_ = std::move(store);
  report_prefix_ = std::move(prefix);
}

Error ProcessGroup::call_failed(const Call& call, StatusCode code, const std::string& cause) {
  std::string missing = report_store_ ? find_missing_ranks(*report_store_, report_prefix_, rank(), size(),
                                                           call.header.seq, call.exchanged, call.deadline)
                                      : std::string("the missing ranks are unknown (no store)");
  return call_failed_knowing(call, code, missing, cause);
}

Error ProcessGroup::call_failed_knowing(const Call& call, StatusCode code, const std::string& missing,
                                        const std::string& cause) {
  return Error(code, str_cat(call_kind_name(call.header.kind), " of ", describe_call(call), " (collective #",
                             call.header.seq, ") on rank ", rank(), " of ", size(),
                             code == StatusCode::kTimeout ? str_cat(" timed out after ", timeout().count(), " ms")
                                                          : std::string(" failed"),
                             ": ", missing, "; ", cause));
}

ProcessGroup::ProcessGroup(int32_t rank, int32_t world_size, Device device, Millis timeout,
                           const BackendFactory& make_backend)
    : CallSite(rank, world_size, device, timeout), backend_(make_backend(*this)) {
  recorder_ = std::make_shared<FlightRecorder>(rank, world_size, backend_->name(), trace_buffer_calls());
  recorder_->set_group_id(str_cat("group of ", world_size, " over ", backend_->name()));
  register_recorder(recorder_);
}

ProcessGroup::~ProcessGroup() { drain(); }

void ProcessGroup::drain() {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    stopping_ = true;
    cv_.notify_all();
  }
  if (worker_.joinable()) worker_.join();
}

void ProcessGroup::abort_calls(const std::string& why) noexcept {
  aborted_.store(true, std::memory_order_release);
  abort(why);
}

void ProcessGroup::abort(const std::string& why) noexcept {
  mark_broken(why);
  backend_->abort(why);
  dump_traces("abort: " + why);
}

std::string ProcessGroup::broken_reason() {
  std::lock_guard<std::mutex> lock(mutex_);
  return broken_;
}

bool ProcessGroup::broken() {
  std::lock_guard<std::mutex> lock(mutex_);
  return !broken_.empty();
}

void ProcessGroup::mark_broken(const std::string& why) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  if (broken_.empty()) broken_ = why.empty() ? "broken" : why;
}

void ProcessGroup::worker_loop() {
  BackgroundCalls::mark_this_thread();
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    cv_.wait(lock, [&] { return (!queue_.empty() && !busy_) || (stopping_ && queue_.empty()); });
    if (queue_.empty()) return;
    auto item = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    item.first();
    lock.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

namespace {
long this_thread_tid() {
  thread_local const long tid = static_cast<long>(::syscall(SYS_gettid));
  return tid;
}
}  // namespace

void ProcessGroup::set_call_gate(std::weak_ptr<CallGate> gate) {
  std::lock_guard<std::mutex> lock(mutex_);
  gate_ = std::move(gate);
}

void ProcessGroup::wait_for_other_threads_calls() {
  std::unique_lock<std::mutex> lock(mutex_);
  cv_.wait(lock, [&] { return calls_in_flight_ == 0 || driver_ == std::this_thread::get_id(); });
}

void ProcessGroup::claim_for_this_thread_locked(CallKind kind) {
  const char* name = call_kind_name(static_cast<uint32_t>(kind));
  if (auto gate = gate_.lock(); gate && !gate->owns_this_thread()) {
    std::string why = gate->refuse_host_call();
    if (!why.empty()) {
      fail(StatusCode::kState, name, ": refused on rank ", rank(),
           " (nothing was sent; the group stays usable): ", why);
    }
  }
  ++submitted_;
  if (calls_in_flight_ > 0 && driver_ != std::this_thread::get_id()) {
    std::string why =
        str_cat("thread ", this_thread_tid(), " called ", name, " (call ", submitted_, " on this rank) while thread ",
                driver_tid_, "'s ", call_kind_name(static_cast<uint32_t>(driver_kind_)), " (call ", driver_call_,
                " on this rank) was in flight; one group is driven by one thread at a time, in the "
                "same order on every rank: use one group per thread");
    if (misdriven_.empty()) misdriven_ = why;
    ++misdrives_;
    fail(StatusCode::kState, name, ": ", why,
         " (the group is unusable now: which call each rank paired with which "
         "is unknown)");
  }
  driver_ = std::this_thread::get_id();
  driver_tid_ = this_thread_tid();
  driver_kind_ = kind;
  driver_call_ = submitted_;
  ++calls_in_flight_;
}

void ProcessGroup::release_claim() {
  std::lock_guard<std::mutex> lock(mutex_);
  --calls_in_flight_;
  cv_.notify_all();
}

void ProcessGroup::refuse_misdriven(CallKind kind) {
  std::string why;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    why = misdriven_;
  }
  std::string reason = str_cat("its process group was driven by several threads at once: ", why);
  try {
    run_refused(kind, reason);
  } catch (const Error& e) {
    if (e.code() != StatusCode::kInvalidArgument) throw;
  }
  fail(StatusCode::kState, call_kind_name(static_cast<uint32_t>(kind)), ": refused on rank ", rank(),
       " (the other ranks' matching call fails too): ", reason);
}

std::shared_ptr<Work> ProcessGroup::submit(CallKind kind, Task task, bool async) {
  origin_.check("this process group");
  auto work = std::make_shared<Work>();
  TraceCall trace = recorder_->issued(kind);
  auto run = [this, kind, trace, task = std::move(task), work]() mutable {
    running_call_.store(&trace, std::memory_order_relaxed);
    Outcome outcome = execute(kind, task);
    running_call_.store(nullptr, std::memory_order_relaxed);
    recorder_->finished(trace, outcome.code == StatusCode::kOk);
    // A peer that stopped answering or went away: what every rank was
    // doing is what a diagnosis needs (DP_TRACE_DIR).
    if (outcome.code == StatusCode::kTimeout || outcome.code == StatusCode::kRemote) dump_traces(outcome.message);
    // Released before the Work finishes: a thread that waited for it may call next.
    release_claim();
    work->finish(outcome.code, std::move(outcome.message));
  };
  std::unique_lock<std::mutex> lock(mutex_);
  try {
    claim_for_this_thread_locked(kind);
  } catch (...) {
    recorder_->finished(trace, false);
    throw;
  }
  if (async) {
    try {
      if (!worker_.joinable()) worker_ = std::thread([this] { worker_loop(); });
      queue_.emplace_back(std::move(run), work);
    } catch (...) {
      --calls_in_flight_;
      throw;
    }
    cv_.notify_all();
    return work;
  }
  // Synchronous collectives run on the caller's thread, after the queued ones.
  cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
  busy_ = true;
  lock.unlock();
  run();
  lock.lock();
  busy_ = false;
  cv_.notify_all();
  lock.unlock();
  work->wait();
  return work;
}

ProcessGroup::Outcome ProcessGroup::execute(CallKind kind, const Task& task) {
  const char* name = call_kind_name(static_cast<uint32_t>(kind));
  uint64_t misdrives_before = 0;
  bool misdriven = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!broken_.empty()) {
      return {StatusCode::kState, str_cat(name, ": the process group is unusable after an earlier failure: ", broken_)};
    }
    misdrives_before = misdrives_;
    misdriven = !misdriven_.empty();
  }
  try {
    if (misdriven) refuse_misdriven(kind);
    task();
    std::lock_guard<std::mutex> lock(mutex_);
    if (misdrives_ != misdrives_before) {
      // Another thread called while this ran: its result may be another call's.
      return {StatusCode::kState, str_cat(name, " on rank ", rank(), ": ", misdriven_,
                                          "; this call ran meanwhile, so which call each rank paired it with is "
                                          "unknown")};
    }
    return {StatusCode::kOk, ""};
  } catch (const Error& e) {
    if (aborted_.load(std::memory_order_acquire)) {
      // What the backend saw of the abort (a closed connection, a peer that
      // gave up) is its consequence, not the cause.
      return {StatusCode::kState, str_cat(name, " on rank ", rank(), ": the process group was aborted (",
                                          broken_reason(), "): ", e.what())};
    }
    if (e.code() == StatusCode::kTimeout || e.code() == StatusCode::kRemote || e.code() == StatusCode::kInternal) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (broken_.empty()) broken_ = e.what();
    }
    return {e.code(), e.what()};
  } catch (const std::bad_alloc&) {
    return {StatusCode::kOutOfMemory, str_cat(name, ": out of memory")};
  } catch (const std::exception& e) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (broken_.empty()) broken_ = e.what();
    return {StatusCode::kInternal, str_cat(name, ": ", e.what())};
  }
}

void ProcessGroup::check_tensor(const Tensor& t, const std::string& argument, const char* op) const {
  if (t.device().type != backend_->tensor_device_type()) {
    fail_invalid(op, ": argument '", argument, "' is ", t.describe(), " but this ", backend_->name(),
                 " process group works on ", backend_->tensor_device_type() == DeviceType::kCpu ? "cpu" : "cuda",
                 " tensors");
  }
  // NCCL would take another GPU's memory and fail, or corrupt it, far from
  // here; a cpu:i is a device of its own as well.
  if (t.device() != device()) {
    fail_invalid(op, ": argument '", argument, "' is ", t.describe(), " but this ", backend_->name(),
                 " process group is on ", to_string(device()));
  }
  if (t.numel() > 0 && t.data() == nullptr) fail_invalid(op, ": argument '", argument, "' has no data");
}

void ProcessGroup::refuse(CallKind kind, const std::string& reason, bool async) {
  const char* name = call_kind_name(static_cast<uint32_t>(kind));
  Task task = [this, kind, reason] { run_refused(kind, reason); };
  if (async) {
    submit(kind, std::move(task), true);
    fail_invalid(name, ": rank ", rank(), " refused the call: ", reason,
                 " (the other ranks' matching call fails too; the group stays usable)");
  }
  try {
    submit(kind, std::move(task), false);
  } catch (const Error& e) {
    // The verdict every rank reached, or this call was not this thread's to make.
    if (e.code() == StatusCode::kInvalidArgument || e.code() == StatusCode::kState) throw;
    fail_invalid(name, ": rank ", rank(), " refused the call: ", reason,
                 "; telling the other ranks failed: ", e.what());
  }
  fail(StatusCode::kInternal, name, ": the header exchange of a refused call passed");
}

std::shared_ptr<Work> ProcessGroup::all_reduce(const Tensor& tensor, ReduceOp op, bool async) {
  check_arguments(CallKind::kAllReduce, async, [&] {
    check_tensor(tensor, "tensor", "all_reduce");
    if (tensor.dtype() == DType::kBool && op == ReduceOp::kAvg)
      fail_invalid("all_reduce: DP_AVG is not defined for bool tensors");
  });
  return submit(
      CallKind::kAllReduce, [this, tensor, op] { backend_->all_reduce(tensor, op); }, async);
}

std::shared_ptr<Work> ProcessGroup::all_reduce_coalesced(const std::vector<Tensor>& tensors, ReduceOp op, bool async) {
  check_arguments(CallKind::kAllReduce, async, [&] {
    if (tensors.empty()) fail_invalid("all_reduce_coalesced: argument 'tensors' is empty");
    for (size_t i = 0; i < tensors.size(); ++i) {
      std::string name = str_cat("tensors[", i, "]");
      check_tensor(tensors[i], name, "all_reduce_coalesced");
      if (tensors[i].dtype() != tensors[0].dtype()) {
        fail_invalid("all_reduce_coalesced: ", name, " is ", tensors[i].describe(), " but tensors[0] is ",
                     tensors[0].describe(), "; every tensor must have one dtype");
      }
    }
    if (tensors[0].dtype() == DType::kBool && op == ReduceOp::kAvg) {
      fail_invalid("all_reduce_coalesced: DP_AVG is not defined for bool tensors");
    }
  });
  return submit(
      CallKind::kAllReduce, [this, tensors, op] { backend_->all_reduce_coalesced(tensors, op); }, async);
}

std::shared_ptr<SharedRegion> ProcessGroup::create_region(size_t bytes) {
  check_arguments(CallKind::kBarrier, false, [&] {
    if (bytes == 0) fail_invalid("create_region: argument 'bytes' is 0");
  });
  std::shared_ptr<SharedRegion> region;
  submit(
      CallKind::kBarrier,
      [this, bytes, &region] {
        if (RegionService* service = backend_->regions()) region = service->create_region(bytes);
      },
      false);
  return region;
}

std::shared_ptr<Storage> ProcessGroup::create_region_storage(size_t bytes, std::string* why, bool all_parts) {
  std::shared_ptr<SharedRegion> region;
  try {
    region = create_region(bytes);
  } catch (const Error& e) {
    if (e.code() != StatusCode::kOutOfMemory) throw;
    if (why != nullptr) *why = e.what();
    return nullptr;
  }
  if (region == nullptr) return nullptr;
  if (all_parts) {
    return Storage::wrap(device(), region->all_parts(), region->bytes() * static_cast<size_t>(size()),
                         [region](void*) {});
  }
  return Storage::wrap(device(), region->data(), region->bytes(), [region](void*) {});
}

std::shared_ptr<Work> ProcessGroup::broadcast(const Tensor& tensor, int32_t root, bool async) {
  check_arguments(CallKind::kBroadcast, async, [&] {
    check_tensor(tensor, "tensor", "broadcast");
    if (root < 0 || root >= size()) {
      fail_invalid("broadcast: argument 'root' is ", root, "; it must be in 0..", size() - 1, " (world size ", size(),
                   ")");
    }
  });
  return submit(
      CallKind::kBroadcast, [this, tensor, root] { backend_->broadcast(tensor, root); }, async);
}

std::shared_ptr<Work> ProcessGroup::all_gather(const Tensor& input, const std::vector<Tensor>& outputs, bool async) {
  check_arguments(CallKind::kAllGather, async, [&] {
    check_tensor(input, "input", "all_gather");
    if (outputs.size() != static_cast<size_t>(size())) {
      fail_invalid("all_gather: argument 'noutputs' is ", outputs.size(), "; it must equal the world size ", size());
    }
    for (size_t i = 0; i < outputs.size(); ++i) {
      std::string name = str_cat("outputs[", i, "]");
      check_tensor(outputs[i], name, "all_gather");
      if (outputs[i].dtype() != input.dtype() || outputs[i].numel() != input.numel()) {
        fail_invalid("all_gather: ", name, " is ", outputs[i].describe(), " but the input is ", input.describe(),
                     "; each output must have the input's dtype and element count");
      }
    }
  });
  return submit(
      CallKind::kAllGather, [this, input, outputs] { backend_->all_gather(input, outputs); }, async);
}

std::shared_ptr<Work> ProcessGroup::all_gather_runs(size_t segment, std::vector<SegmentRun> sources,
                                                    std::vector<std::vector<SegmentRun>> places, bool async) {
  check_arguments(CallKind::kAllGather, async, [&] {
    if (segment == 0 || segment > static_cast<size_t>(std::numeric_limits<int64_t>::max())) {
      fail_invalid("all_gather: argument 'segment' is ", segment, "; it must be 1 to 2^63-1 bytes");
    }
    if (places.size() != static_cast<size_t>(size())) {
      fail_invalid("all_gather: argument 'places' has ", places.size(), " lists; it must equal the world size ",
                   size());
    }
    auto check_runs = [&](const std::vector<SegmentRun>& runs, const std::string& name) {
      for (size_t i = 0; i < runs.size(); ++i) {
        const std::string argument = str_cat(name, "[", i, "]");
        check_tensor(runs[i].view, argument, "all_gather");
        if (runs[i].offset > segment || runs[i].view.nbytes() > segment - runs[i].offset) {
          fail_invalid("all_gather: ", argument, " covers bytes ", runs[i].offset, " to ",
                       runs[i].offset + runs[i].view.nbytes(), " of a ", segment, "-byte segment");
        }
      }
    };
    check_runs(sources, "sources");
    for (size_t q = 0; q < places.size(); ++q) check_runs(places[q], str_cat("places[", q, "]"));
  });
  return submit(
      CallKind::kAllGather,
      [this, segment, sources = std::move(sources), places = std::move(places)] {
        backend_->all_gather_runs(segment, sources, places);
      },
      async);
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter_runs(std::vector<std::vector<SegmentRun>> parts,
                                                        const Tensor& output, ReduceOp op, bool async,
                                                        bool accumulate) {
  check_arguments(CallKind::kReduceScatter, async, [&] {
    check_tensor(output, "output", "reduce_scatter");
    if (output.dtype() == DType::kBool && op == ReduceOp::kAvg) {
      fail_invalid("reduce_scatter: DP_AVG is not defined for bool tensors");
    }
    if (parts.size() != static_cast<size_t>(size())) {
      fail_invalid("reduce_scatter: argument 'parts' has ", parts.size(), " lists; it must equal the world size ",
                   size());
    }
    const size_t part = output.nbytes();
    for (size_t q = 0; q < parts.size(); ++q) {
      size_t end = 0;
      for (size_t i = 0; i < parts[q].size(); ++i) {
        const SegmentRun& run = parts[q][i];
        const std::string argument = str_cat("parts[", q, "][", i, "]");
        check_tensor(run.view, argument, "reduce_scatter");
        if (run.view.dtype() != output.dtype() || run.offset % output.element_size() != 0) {
          fail_invalid("reduce_scatter: ", argument, " is ", run.view.describe(), " at byte ", run.offset,
                       " but the output is ", output.describe());
        }
        if (run.offset < end || run.offset > part || run.view.nbytes() > part - run.offset) {
          fail_invalid("reduce_scatter: ", argument, " covers bytes ", run.offset, " to ",
                       run.offset + run.view.nbytes(), " of a ", part,
                       "-byte part, overlapping the run before it or past the part");
        }
        const auto* a = static_cast<const uint8_t*>(run.view.data());
        const auto* b = static_cast<const uint8_t*>(output.data());
        if (run.view.nbytes() > 0 && part > 0 && a < b + part && b < a + run.view.nbytes()) {
          fail_invalid("reduce_scatter: ", argument, " overlaps argument 'output'");
        }
        end = run.offset + run.view.nbytes();
      }
    }
  });
  return submit(
      CallKind::kReduceScatter,
      [this, parts = std::move(parts), output, op, accumulate] {
        backend_->reduce_scatter_runs(parts, output, op, accumulate);
      },
      async);
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter(const std::vector<Tensor>& inputs, const Tensor& output, ReduceOp op,
                                                   bool async) {
  check_arguments(CallKind::kReduceScatter, async, [&] {
    check_tensor(output, "output", "reduce_scatter");
    if (output.dtype() == DType::kBool && op == ReduceOp::kAvg) {
      fail_invalid("reduce_scatter: DP_AVG is not defined for bool tensors");
    }
    if (inputs.size() != static_cast<size_t>(size())) {
      fail_invalid("reduce_scatter: argument 'ninputs' is ", inputs.size(), "; it must equal the world size ", size());
    }
    for (size_t i = 0; i < inputs.size(); ++i) {
      std::string name = str_cat("inputs[", i, "]");
      check_tensor(inputs[i], name, "reduce_scatter");
      if (inputs[i].dtype() != output.dtype() || inputs[i].numel() != output.numel()) {
        fail_invalid("reduce_scatter: ", name, " is ", inputs[i].describe(), " but the output is ", output.describe(),
                     "; each input must have the output's dtype and element count");
      }
    }
  });
  return submit(
      CallKind::kReduceScatter, [this, inputs, output, op] { backend_->reduce_scatter(inputs, output, op); }, async);
}

std::shared_ptr<Work> ProcessGroup::barrier(bool async) {
  return submit(
      CallKind::kBarrier, [this] { backend_->barrier(); }, async);
}

void check_process_group_options(const ProcessGroupOptions& options) {
  if (options.world_size <= 0) fail_invalid("argument 'world_size' is ", options.world_size, "; it must be >= 1");
  if (options.rank < 0 || options.rank >= options.world_size) {
    fail_invalid("argument 'rank' is ", options.rank, "; it must be in 0..", options.world_size - 1, " (world size ",
                 options.world_size, ")");
  }
  if (options.timeout.count() <= 0) {
    fail_invalid("argument 'timeout_ms' is ", options.timeout.count(), "; it must be > 0");
  }
  const BackendEntry* asked = find_backend(options.backend);
  if (asked == nullptr) {
    std::string values;
    const std::vector<BackendEntry>& rows = backend_registry();
    for (size_t i = 0; i < rows.size(); ++i) {
      values += str_cat(i == 0 ? "" : i + 1 == rows.size() ? " or " : ", ", rows[i].request);
    }
    fail_invalid("argument 'backend' is ", static_cast<int32_t>(options.backend), "; it must be ", values);
  }
  // AUTO runs on every device; the others on their own.
  if (asked->make == nullptr || asked->device == options.device.type) return;
  std::string instead = "DP_BACKEND_AUTO";
  for (const BackendEntry& entry : backend_registry()) {
    if (entry.make != nullptr && entry.crosses_hosts && entry.device == options.device.type) {
      instead += str_cat(" or ", entry.request);
    }
  }
  fail_invalid("argument 'device' is ", to_string(options.device), " but the ", asked->title, " backend works on ",
               asked->device == DeviceType::kCpu ? "cpu" : "cuda", " tensors; use ", instead);
}

std::unique_ptr<ProcessGroup> make_process_group(const ProcessGroupOptions& options,
                                                 const BackendFactory& make_backend) {
  return std::make_unique<ProcessGroup>(options.rank, options.world_size, options.device, options.timeout,
                                        make_backend);
}

std::unique_ptr<ProcessGroup> create_process_group(const ProcessGroupOptions& options) {
  check_process_group_options(options);
  if (!options.store) fail_invalid("argument 'store' is NULL: pass one in the options");
  return create_chosen_process_group(options);
}

}  // namespace dparallel::dist
