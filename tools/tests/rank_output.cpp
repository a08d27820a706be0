// A rank for dp-run's output tests, linked against libdparallel as a job's
// program is, writing through C stdio the way such programs do.
//
//   dp_run_test_rank interleave N     N lines to stdout and N to stderr, alternating
//   dp_run_test_rank line-then-wait F  one stdout line, no flush, then waits for file F
#include <dparallel/dparallel.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

namespace {

int rank() {
  const char* text = std::getenv("RANK");
  return text == nullptr ? -1 : std::atoi(text);
}

// Lines of varying length, so that a 4 KiB stdio block ends mid-line.
int interleave(long count) {
  const int r = rank();
  const std::string padding(97, '.');
  for (long i = 0; i < count; ++i) {
    const int pad = static_cast<int>(i % 97);
    std::printf("out %d %ld %.*s|\n", r, i, pad, padding.c_str());
    std::fprintf(stderr, "err %d %ld %.*s|\n", r, i, 96 - pad, padding.c_str());
  }
  return 0;
}

int line_then_wait(const char* path) {
  std::printf("step 1 of 2 on rank %d\n", rank());
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (::access(path, F_OK) != 0) {
    if (std::chrono::steady_clock::now() > give_up) return 3;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::printf("step 2 of 2 on rank %d\n", rank());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // The library is linked for what it does when it loads under dp-run.
  if (dp_version_number() == 0) return 4;
  if (argc == 3 && std::strcmp(argv[1], "interleave") == 0) return interleave(std::atol(argv[2]));
  if (argc == 3 && std::strcmp(argv[1], "line-then-wait") == 0) return line_then_wait(argv[2]);
  std::fprintf(stderr, "usage: dp_run_test_rank interleave N | line-then-wait FILE\n");
  return 2;
}
