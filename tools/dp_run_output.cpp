#include "dp_run_output.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace dprun {

namespace {

// Set once writing to stdout or stderr failed with EPIPE: its reader is gone.
bool g_output_lost = false;

// An unfinished line that waited this long is shown as it is (progress);
// once its rank pauses this long, another rank's output may end it.
constexpr auto kShowUnfinishedAfter = std::chrono::milliseconds(100);
// A shown line shorter than the buffer may be ended for another rank's
// output after this long, so that a growing progress line does not hold the
// other ranks back. A longer one goes out in pieces that nothing else comes
// between while its rank writes it: it may be ended once the rank paused
// this long.
constexpr auto kLongLinePause = std::chrono::seconds(1);

// dp-run's stdout or stderr, where the ranks' stdout or stderr lines go.
struct Sink {
  int fd;
  int open_rank = -1;  // the index of the rank whose line is started here but not ended; -1 if none
  size_t open_length = 0;
  Clock::time_point open_since{};
  std::string out;  // what goes out next; kept, so that its memory is reused
};
Sink g_sinks[2] = {{STDOUT_FILENO}, {STDERR_FILENO}};
// Whether dp-run's stdout and stderr are one file (a terminal, `2>&1`): then
// a line started on one is ended before anything goes to the other.
bool g_sinks_shared = false;

bool same_file(int a, int b) {
  struct stat sa {
  }, sb{};
  return ::fstat(a, &sa) == 0 && ::fstat(b, &sb) == 0 && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino;
}

// Writes all of `data` as it is (bytes, NULs too).
void write_all(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
    } else if (n < 0 && errno == EINTR) {
    } else if (n < 0 && errno == EAGAIN) {  // a non-blocking file description shared with another program
      pollfd p{fd, POLLOUT, 0};
      ::poll(&p, 1, 100);
    } else {
      if (n < 0 && errno == EPIPE) g_output_lost = true;
      return;
    }
  }
}

// Reads what the stream has, as far as its buffer has room.
void read_stream(RankStream& stream, Clock::time_point now) {
  char buf[kBufferSize];
  while (stream.fd >= 0 && stream.buffered.size() < kBufferSize) {
    ssize_t n = ::read(stream.fd, buf, kBufferSize - stream.buffered.size());
    if (n > 0) {
      if (stream.buffered.empty()) stream.unfinished_since = now;
      stream.buffered.append(buf, static_cast<size_t>(n));
      stream.last_read = now;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;
    ::close(stream.fd);
    stream.fd = -1;
  }
}

// Drops the first `count` bytes written; what is left began with the last read, at the latest.
void consume(RankStream& stream, size_t count) {
  stream.buffered.erase(0, count);
  stream.unfinished_since = stream.last_read;
}

bool unfinished_waited(const RankStream& stream, Clock::time_point now) {
  return now - stream.unfinished_since >= kShowUnfinishedAfter;
}

// Whether the stream has output that would be written to a free sink now.
bool has_output_ready(const RankStream& stream, Clock::time_point now) {
  return !stream.buffered.empty() &&
         (stream.buffered.size() >= kBufferSize || stream.fd < 0 || unfinished_waited(stream, now) ||
          stream.buffered.find('\n') != std::string::npos);
}

// Whether a rank other than `except` has output for the sink `which`.
bool others_waiting(const std::vector<RankOutput>& ranks, Stream which, Clock::time_point now, int except) {
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (static_cast<int>(i) != except && has_output_ready(ranks[i].streams[which], now)) return true;
  }
  return false;
}

// Whether the sink's started line may be ended for other output (see
// kLongLinePause); always once its stream is at its end.
bool open_line_may_end(const Sink& sink, const RankStream& owner, Clock::time_point now) {
  if (owner.fd < 0) return true;
  const auto paused = now - owner.last_read;
  return sink.open_length >= kBufferSize ? paused >= kLongLinePause
                                         : paused >= kShowUnfinishedAfter || now - sink.open_since >= kLongLinePause;
}

// Ends the line started on `sink`, if any.
void end_open_line(Sink& sink) {
  if (sink.open_rank < 0) return;
  sink.open_rank = -1;
  write_all(sink.fd, "\n");
}

// Writes what the ranks' `which` streams hold to its sink: whole lines, each
// with its rank's prefix; an unfinished line once it waited, its stream is
// at its end, or it fills the buffer. While a rank's line is started on the
// sink, only that rank's bytes go there, until it ends the line or another
// rank has output waiting and the line may be ended (kShowUnfinishedAfter,
// kLongLinePause); then dp-run ends it.
void forward(std::vector<RankOutput>& ranks, Stream which, Clock::time_point now) {
  Sink& sink = g_sinks[which];
  if (g_output_lost) {
    for (RankOutput& r : ranks) r.streams[which].buffered.clear();
    sink.open_rank = -1;
    return;
  }
  // On a shared file, the other sink's started line ends first, or this sink waits.
  Sink& other = g_sinks[1 - which];
  if (g_sinks_shared && other.open_rank >= 0 && others_waiting(ranks, which, now, -1)) {
    const RankStream& owner = ranks[static_cast<size_t>(other.open_rank)].streams[1 - which];
    if (!open_line_may_end(other, owner, now)) return;
    end_open_line(other);
  }
  std::string& out = sink.out;
  out.clear();
  if (sink.open_rank >= 0) {
    const auto owner = static_cast<size_t>(sink.open_rank);
    RankStream& stream = ranks[owner].streams[which];
    const size_t nl = stream.buffered.find('\n');
    if (nl != std::string::npos) {
      out.append(stream.buffered, 0, nl + 1);
      consume(stream, nl + 1);
      sink.open_rank = -1;
    } else {
      sink.open_length += stream.buffered.size();
      out += stream.buffered;
      stream.buffered.clear();
      if (stream.fd < 0 ||
          (others_waiting(ranks, which, now, sink.open_rank) && open_line_may_end(sink, stream, now))) {
        out += '\n';
        sink.open_rank = -1;
      }
    }
  }
  for (size_t i = 0; i < ranks.size() && sink.open_rank < 0; ++i) {
    RankStream& stream = ranks[i].streams[which];
    if (stream.buffered.empty()) continue;
    const std::string prefix = "[rank " + std::to_string(ranks[i].rank) + "] ";
    size_t start = 0;
    for (size_t nl; (nl = stream.buffered.find('\n', start)) != std::string::npos; start = nl + 1) {
      out += prefix;
      out.append(stream.buffered, start, nl + 1 - start);
    }
    if (start > 0) consume(stream, start);
    if (stream.buffered.empty()) continue;
    if (stream.fd >= 0 && stream.buffered.size() < kBufferSize && !unfinished_waited(stream, now)) continue;
    out += prefix;
    out += stream.buffered;
    if (stream.fd < 0) {
      out += '\n';
    } else {
      sink.open_rank = static_cast<int>(i);
      sink.open_length = stream.buffered.size();
      sink.open_since = now;
    }
    stream.buffered.clear();
  }
  write_all(sink.fd, out);
}

}  // namespace

void init_sinks() { g_sinks_shared = same_file(STDOUT_FILENO, STDERR_FILENO); }

bool output_lost() { return g_output_lost; }

void pump(std::vector<RankOutput>& ranks) {
  const auto now = Clock::now();
  for (RankOutput& r : ranks) {
    for (RankStream& stream : r.streams) read_stream(stream, now);
  }
  forward(ranks, kStdout, now);
  forward(ranks, kStderr, now);
}

void add_readable(const std::vector<RankOutput>& ranks, std::vector<pollfd>& fds) {
  for (const RankOutput& r : ranks) {
    for (const RankStream& stream : r.streams) {
      if (stream.fd >= 0 && stream.buffered.size() < kBufferSize) fds.push_back({stream.fd, POLLIN, 0});
    }
  }
}

void say(const std::string& text) {
  end_open_line(g_sinks[kStderr]);
  if (g_sinks_shared) end_open_line(g_sinks[kStdout]);
  write_all(STDERR_FILENO, "dp-run: " + text + "\n");
}

void finish_output(std::vector<RankOutput>& ranks) {
  auto give_up = Clock::now() + std::chrono::seconds(1);
  auto any_stream_open = [&] {
    for (const RankOutput& r : ranks) {
      if (r.streams[kStdout].fd >= 0 || r.streams[kStderr].fd >= 0) return true;
    }
    return false;
  };
  while (any_stream_open() && Clock::now() < give_up) {
    std::vector<pollfd> fds;
    add_readable(ranks, fds);
    ::poll(fds.data(), fds.size(), 50);
    pump(ranks);
  }
  for (RankOutput& r : ranks) {
    for (RankStream& stream : r.streams) {
      read_stream(stream, Clock::now());
      if (stream.fd >= 0) ::close(stream.fd);
      stream.fd = -1;
    }
  }
  pump(ranks);  // with every stream at its end, this writes all that is left
}

}  // namespace dprun
