#include "distributed/flight_recorder.h"

#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_name.h"
#include "distributed/collective.h"

namespace dparallel::dist {

namespace {

int64_t now_us() {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

const char* state_name(uint32_t state) {
  switch (state) {
    case TraceCall::kIssued:
      return "issued";
    case TraceCall::kStarted:
      return "started";
    case TraceCall::kDone:
      return "done";
    default:
      return "failed";
  }
}

// The recorders of the live groups. Leaked on purpose: the SIGUSR1 dumper
// thread may use it while the process exits.
struct Registry {
  std::mutex mutex;
  std::vector<std::weak_ptr<FlightRecorder>> recorders;
  int wake_fd = -1;  // SIGUSR1's handler writes here; the dumper thread reads
};
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

void on_sigusr1(int) {
  const int saved = errno;
  const char byte = 1;
  if (registry().wake_fd >= 0) (void)!::write(registry().wake_fd, &byte, 1);
  errno = saved;
}

// SIGUSR1 dumps, where the host left its action at the default (which would
// end the process). The handler only writes a byte; a thread does the rest.
void install_sigusr1_dumper() {
  struct sigaction current {};
  if (::sigaction(SIGUSR1, nullptr, &current) != 0 || current.sa_handler != SIG_DFL ||
      (current.sa_flags & SA_SIGINFO) != 0) {
    return;
  }
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) return;
  int read_fd = fds[0];
  ::fcntl(read_fd, F_SETFL, 0);  // the dumper blocks on it
  registry().wake_fd = fds[1];
  try {
    std::thread([read_fd] {
      name_this_thread("dp-trace-dump");
      char byte = 0;
      for (;;) {
        const ssize_t n = ::read(read_fd, &byte, 1);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;
        dump_traces("SIGUSR1");
      }
    }).detach();
  } catch (...) {
    return;  // no thread: SIGUSR1 keeps its default action
  }
  struct sigaction dump {};
  dump.sa_handler = on_sigusr1;
  sigemptyset(&dump.sa_mask);
  dump.sa_flags = SA_RESTART;
  ::sigaction(SIGUSR1, &dump, nullptr);
}

std::string trace_dir() {
  const char* dir = std::getenv("DP_TRACE_DIR");
  return dir != nullptr ? dir : "";
}

}  // namespace

FlightRecorder::FlightRecorder(int32_t rank, int32_t size, std::string backend, size_t capacity)
    : rank_(rank),
      size_(size),
      backend_(std::move(backend)),
      slots_(capacity > 0 ? new Slot[capacity] : nullptr),
      capacity_(capacity) {}

void FlightRecorder::set_group_id(const std::string& id) {
  std::lock_guard<std::mutex> lock(id_mutex_);
  group_id_ = id;
  id_history_.push_back(std::make_unique<std::string>(id));
  published_id_.store(id_history_.back()->c_str(), std::memory_order_release);
}

std::string FlightRecorder::group_id() const {
  const char* id = published_id_.load(std::memory_order_acquire);
  return id != nullptr ? id : "";
}

bool FlightRecorder::read(const Slot& slot, TraceCall& out) const noexcept {
  const uint64_t before = slot.version.load(std::memory_order_acquire);
  if ((before & 1) != 0) return false;
  uint64_t words[kWords];
  for (size_t i = 0; i < kWords; ++i) words[i] = slot.words[i].load(std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_acquire);
  if (slot.version.load(std::memory_order_relaxed) != before) return false;
  std::memcpy(&out, words, sizeof out);
  return out.id != 0;
}

void FlightRecorder::write(Slot& slot, const TraceCall& call) noexcept {
  uint64_t words[kWords] = {};
  std::memcpy(words, &call, sizeof call);
  const uint64_t v = slot.version.load(std::memory_order_relaxed);
  slot.version.store(v + 1, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  for (size_t i = 0; i < kWords; ++i) slot.words[i].store(words[i], std::memory_order_relaxed);
  slot.version.store(v + 2, std::memory_order_release);
}

TraceCall FlightRecorder::issued(CallKind kind) noexcept {
  TraceCall call;
  if (capacity_ == 0) return call;
  call.id = next_id_.fetch_add(1, std::memory_order_relaxed) + 1;
  call.kind = static_cast<uint32_t>(kind);
  call.issued_us = now_us();
  write(slots_[call.id % capacity_], call);
  return call;
}

void FlightRecorder::rewrite(const TraceCall& call) noexcept {
  // Only this call's thread writes its slot, until capacity later calls
  // were issued and one of them took it.
  if (call.id == 0 || next_id_.load(std::memory_order_relaxed) - call.id >= capacity_) return;
  write(slots_[call.id % capacity_], call);
}

void FlightRecorder::started(TraceCall& call, const CallHeader& header) noexcept {
  call.seq = header.seq;
  call.kind = header.kind;
  call.dtype = header.dtype;
  call.op = header.op;
  call.root = header.root;
  call.numel = header.numel;
  call.refused = header.refused;
  call.tag = header.tag;
  call.state = TraceCall::kStarted;
  call.started_us = now_us();
  rewrite(call);
}

void FlightRecorder::finished(TraceCall& call, bool ok) noexcept {
  call.state = ok ? TraceCall::kDone : TraceCall::kFailed;
  call.ended_us = now_us();
  rewrite(call);
}

std::vector<TraceCall> FlightRecorder::snapshot() const {
  std::vector<TraceCall> calls;
  if (capacity_ == 0) return calls;
  const uint64_t last = next_id_.load(std::memory_order_relaxed);
  const uint64_t first = last > capacity_ ? last - capacity_ + 1 : 1;
  calls.reserve(static_cast<size_t>(last - first + 1));
  for (uint64_t id = first; id <= last; ++id) {
    TraceCall call;
    if (read(slots_[id % capacity_], call) && call.id == id) calls.push_back(call);
  }
  return calls;
}

size_t trace_buffer_calls() {
  static const size_t calls = [] {
    const char* text = std::getenv("DP_TRACE_BUFFER");
    if (text == nullptr || *text == '\0') return size_t{2000};
    char* end = nullptr;
    const long long n = std::strtoll(text, &end, 10);
    if (end == text || *end != '\0' || n < 0) return size_t{2000};
    return static_cast<size_t>(std::min<long long>(n, 1000000));
  }();
  return calls;
}

void register_recorder(const std::shared_ptr<FlightRecorder>& recorder) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  static bool dumper_installed = false;
  if (!dumper_installed && !trace_dir().empty()) {
    dumper_installed = true;
    install_sigusr1_dumper();
  }
  // Forget the groups that are gone, so that the list stays as long as the live ones.
  auto& list = r.recorders;
  list.erase(std::remove_if(list.begin(), list.end(), [](const auto& w) { return w.expired(); }), list.end());
  list.push_back(recorder);
}

std::string traces_json(const std::vector<std::shared_ptr<FlightRecorder>>& recorders, const std::string& reason) {
  using nlohmann::json;
  json groups = json::array();
  for (const auto& recorder : recorders) {
    json calls = json::array();
    for (const TraceCall& c : recorder->snapshot()) {
      json call = {{"id", c.id},
                   {"seq", c.seq},
                   {"call", call_kind_name(c.kind)},
                   {"state", state_name(c.state)},
                   {"issued_us", c.issued_us},
                   {"started_us", c.started_us},
                   {"ended_us", c.ended_us}};
      if (c.state != TraceCall::kIssued) {
        call["dtype"] = dtype_is_valid(c.dtype) ? dtype_name(static_cast<DType>(c.dtype)) : "none";
        call["numel"] = c.numel;
        call["op"] = reduce_op_name(static_cast<ReduceOp>(c.op));
        call["root"] = c.root;
        call["caller"] = describe_call_tag(c.tag);
        if (c.refused != 0) call["refused"] = true;
      }
      calls.push_back(std::move(call));
    }
    groups.push_back({{"group", recorder->group_id()},
                      {"rank", recorder->rank()},
                      {"size", recorder->size()},
                      {"backend", recorder->backend()},
                      {"calls", std::move(calls)}});
  }
  const char* rank = std::getenv("RANK");
  json dump = {{"format", "dparallel-trace-1"},
               {"rank", rank != nullptr ? json(std::atoi(rank)) : json(nullptr)},
               {"pid", static_cast<int64_t>(::getpid())},
               {"reason", reason},
               {"time_us", now_us()},
               {"groups", std::move(groups)}};
  return dump.dump(1);
}

std::string dump_traces(const std::string& reason) noexcept {
  try {
    const std::string dir = trace_dir();
    if (dir.empty()) return "";
    std::vector<std::shared_ptr<FlightRecorder>> recorders;
    Registry& r = registry();
    // The failing path must not wait on a lock another stuck thread holds:
    // try for a while, then dump nothing rather than hang.
    std::unique_lock<std::mutex> lock(r.mutex, std::defer_lock);
    for (int tries = 0; tries < 200 && !lock.try_lock(); ++tries) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    if (!lock.owns_lock()) return "";
    for (const auto& w : r.recorders) {
      if (auto recorder = w.lock()) recorders.push_back(std::move(recorder));
    }
    lock.unlock();
    const std::string text = traces_json(recorders, reason);
    const char* rank = std::getenv("RANK");
    const std::string name = rank != nullptr && *rank != '\0' ? str_cat("rank", rank) : str_cat("pid", ::getpid());
    std::string path = str_cat(dir, "/", name, ".json");
    const std::string partial = str_cat(path, ".", ::getpid(), ".part");
    const int fd = ::open(partial.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return "";
    size_t written = 0;
    while (written < text.size()) {
      const ssize_t n = ::write(fd, text.data() + written, text.size() - written);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      written += static_cast<size_t>(n);
    }
    const bool closed = ::close(fd) == 0;
    const bool whole = written == text.size() && closed;
    if (!whole || ::rename(partial.c_str(), path.c_str()) != 0) {
      ::unlink(partial.c_str());
      return "";
    }
    return path;
  } catch (...) {
    return "";
  }
}

}  // namespace dparallel::dist
