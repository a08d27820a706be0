// dp-run's output pump: reads each rank's stdout and stderr pipes and
// writes their lines, prefixed with the rank, to dp-run's stdout and stderr
// (kOutputHelp says how, for --help).
#pragma once

#include <poll.h>

#include <chrono>
#include <cstddef>
#include <string>
#include <vector>

namespace dprun {

using Clock = std::chrono::steady_clock;

inline constexpr const char* kOutputHelp =
    "Each rank's stdout lines go to dp-run's stdout and its stderr lines to dp-run's stderr, whole and\n"
    "prefixed with \"[rank R] \". A line without its newline yet shows after 0.1 s (progress); once\n"
    "the rank pauses for 0.1 s, or after 1 s, another line may end it (another rank's, or one for\n"
    "dp-run's other stream when both are one file, as a terminal is), and it ends when the rank\n"
    "exits. A line longer than 64 KiB goes out in pieces that nothing comes between while the rank\n"
    "writes it; paused for 1 s, another line may end it.\n"
    "\n"
    "Ranks get DP_LINE_BUFFERED_STDOUT=1, on which libdparallel makes their stdout line-buffered.\n"
    "A program not linked against libdparallel must do that itself (C: setvbuf(stdout, NULL, _IOLBF, 0)\n"
    "first thing in main; Python: python -u) or flush its stdout, or its lines come 4 KiB at a time.\n"
    "Text without a newline shows only once the program has written it (flushed it, in C).\n";

// What dp-run holds of one rank's stream: a rank's endless line never piles
// up in dp-run's memory, and a rank that outwrites dp-run's output waits.
constexpr size_t kBufferSize = size_t{64} * 1024;

// One of a rank's output streams, read through a pipe of its own.
struct RankStream {
  int fd = -1;           // the read end; -1 once at its end
  std::string buffered;  // read, not yet written: at most kBufferSize bytes
  Clock::time_point last_read{};
  Clock::time_point unfinished_since{};  // when (at the latest) the unfinished line in `buffered` began
};

enum Stream { kStdout = 0, kStderr = 1 };

// One rank's output: its stdout and stderr, by Stream.
struct RankOutput {
  int rank = 0;
  RankStream streams[2];
};

// Looks once, before any output, whether dp-run's stdout and stderr are one
// file (a terminal, `2>&1`).
void init_sinks();
// Whether writing to stdout or stderr failed with EPIPE: its reader is gone.
bool output_lost();
// Moves what the ranks wrote to dp-run's stdout and stderr.
void pump(std::vector<RankOutput>& ranks);

// The streams with room in their buffers, to poll.
void add_readable(const std::vector<RankOutput>& ranks, std::vector<pollfd>& fds);

// dp-run's own message on its stderr, on a line of its own.
void say(const std::string& text);

// The ranks are gone; writes what they left, but does not wait on a leftover
// child of theirs that still holds a pipe.
void finish_output(std::vector<RankOutput>& ranks);

}  // namespace dprun
