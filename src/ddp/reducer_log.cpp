// The reducer's log (DP_DEBUG) and timeline (DP_TIMELINE).
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>

#include "core/error.h"
#include "ddp/reducer.h"

namespace dparallel::ddp {

namespace {

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    out += c;
  }
  return out;
}

int64_t micros(Reducer::Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch()).count();
}

}  // namespace

void Reducer::log_plan(const std::string& title) const {
  if (debug_ == lane::DebugLevel::kOff) return;
  std::fprintf(stderr, "[dparallel ddp rank %d] %s:\n", group_->rank(), title.c_str());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    std::fprintf(stderr, "[dparallel ddp rank %d]   bucket %zu: %s, %zu bytes: %s\n", group_->rank(), b,
                 dtype_name(buckets_[b].dtype), static_cast<size_t>(buckets_[b].numel) * dtype_size(buckets_[b].dtype),
                 describe_params(buckets_[b].params).c_str());
  }
}

void Reducer::trace(const std::string& event) { trace_events_.push_back(event); }

void Reducer::trace_mark(size_t index, Clock::time_point now) {
  if (timeline_path_.empty()) return;
  trace(str_cat("{\"name\":\"ready ", json_escape(params_[index].name),
                "\",\"ph\":\"i\",\"s\":\"t\",\"tid\":0,\"ts\":", micros(now), "}"));
}

void Reducer::trace_iteration(Clock::time_point finish_start, Clock::time_point reduced) {
  if (timeline_path_.empty()) return;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const JobState& job = buckets_[b].job;
    trace(str_cat("{\"name\":\"reduce bucket ", b, "\",\"ph\":\"X\",\"tid\":1,\"ts\":", micros(job.start),
                  ",\"dur\":", micros(job.end) - micros(job.start), "}"));
  }
  trace(str_cat("{\"name\":\"finish_backward wait\",\"ph\":\"X\",\"tid\":0,\"ts\":", micros(finish_start),
                ",\"dur\":", micros(reduced) - micros(finish_start), "}"));
}

// Appends this rank's events to the shared trace file; ranks take turns
// under an advisory lock. The file is a JSON array left open at the end,
// which trace viewers accept.
void Reducer::flush_trace() {
  std::vector<std::string> events;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    events.swap(trace_events_);
  }
  if (timeline_path_.empty() || events.empty()) return;
  const int32_t rank = group_->rank();
  // Steady-clock stamps are per boot; the ranks of one host share them.
  std::string text;
  auto add = [&](const std::string& event) {
    std::string with_pid = event;
    with_pid.insert(1, str_cat("\"pid\":", rank, ","));
    text += ",\n" + with_pid;
  };
  add(str_cat("{\"name\":\"process_name\",\"ph\":\"M\",\"args\":{\"name\":\"rank ", rank, "\"}}"));
  for (const auto& e : events) add(e);
  int fd = ::open(timeline_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (fd < 0) return;
  if (::flock(fd, LOCK_EX) == 0) {
    struct stat st {};
    if (::fstat(fd, &st) == 0 && st.st_size == 0) text.replace(0, 1, "[");
    const char* p = text.data();
    size_t left = text.size();
    while (left > 0) {
      ssize_t n = ::write(fd, p, left);
      if (n <= 0) break;
      p += n;
      left -= static_cast<size_t>(n);
    }
    ::flock(fd, LOCK_UN);
  }
  ::close(fd);
}

}  // namespace dparallel::ddp
