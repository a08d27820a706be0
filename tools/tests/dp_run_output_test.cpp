// dp-run forwarding the ranks' output: whole lines on their own stream,
// unfinished lines shown while a rank waits, long and NUL-carrying lines kept
// whole, never holding back another rank's lines.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "dp_run_job.h"

namespace {

using namespace dp_run_test;

// The lines of `text` without their newlines; an unfinished last one too.
std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  size_t start = 0;
  for (size_t nl; (nl = text.find('\n', start)) != std::string::npos; start = nl + 1) {
    lines.push_back(text.substr(start, nl - start));
  }
  if (start < text.size()) lines.push_back(text.substr(start));
  return lines;
}

bool starts_with(const std::string& text, const std::string& prefix) {
  return text.compare(0, prefix.size(), prefix) == 0;
}

TEST(DpRunOutput, ForwardsALineWithANulByteWhole) {
  using namespace std::string_literals;
  Job job;
  ASSERT_TRUE(job.start({"-n", "1", "sh", "-c", "printf 'before\\000after\\n'"}, {}));
  int status = job.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "dp-run ended with " << exit_text(status);
  EXPECT_EQ(job.output(), "[rank 0] before\0after\n"s);
}

// What dp_run_test_rank's `interleave` writes to `stream` ("out" or "err"),
// checked line by line: each whole, prefixed with its rank, in its order.
void expect_interleaved_lines(const std::string& text, const std::string& stream, int ranks, long count) {
  std::vector<long> next(static_cast<size_t>(ranks), 0);
  std::vector<std::string> wrong;
  for (const std::string& line : lines_of(text)) {
    int rank = -1;
    long index = -1;
    bool expected = std::sscanf(line.c_str(), "[rank %d] %*s %*d %ld", &rank, &index) == 2 && rank >= 0 &&
                    rank < ranks && index == next[static_cast<size_t>(rank)];
    if (expected) {
      const long dots = stream == "out" ? index % 97 : 96 - index % 97;
      expected = line == "[rank " + std::to_string(rank) + "] " + stream + " " + std::to_string(rank) + " " +
                             std::to_string(index) + " " + std::string(static_cast<size_t>(dots), '.') + "|";
    }
    if (expected) {
      ++next[static_cast<size_t>(rank)];
    } else if (wrong.size() < 5) {
      wrong.push_back(line.substr(0, 300));
    }
  }
  std::string shown;
  for (const std::string& line : wrong) shown += "  " + line + "\n";
  EXPECT_TRUE(wrong.empty()) << "lines on dp-run's std" << stream << " that are not whole, in order, or its own:\n"
                             << shown;
  for (int rank = 0; rank < ranks; ++rank) {
    EXPECT_EQ(next[static_cast<size_t>(rank)], count) << "rank " << rank << "'s std" << stream << " lines";
  }
}

// Each rank writes its stdout through stdio's buffer and its stderr
// unbuffered, alternating, as fast as it can.
TEST(DpRunOutput, KeepsEveryStdoutAndStderrLineWholeOnItsOwnStream) {
  constexpr long kLines = 20000;
  Job job;
  Job::Options options;
  options.separate_stderr = true;
  ASSERT_TRUE(job.start({"-n", "2", DP_RUN_TEST_RANK, "interleave", std::to_string(kLines)}, options));
  int status = job.wait();
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "dp-run ended with " << exit_text(status);
  expect_interleaved_lines(job.output(), "out", 2, kLines);
  expect_interleaved_lines(job.error_output(), "err", 2, kLines);
}

// A program linked against the library writes each stdout line as it ends,
// not once stdio's buffer fills.
TEST(DpRunOutput, ShowsARanksStdoutLineBeforeItsProgramFlushes) {
  Job job;
  const std::string go = job.dir() + "/go";
  ASSERT_TRUE(job.start({"-n", "1", DP_RUN_TEST_RANK, "line-then-wait", go}, {}));
  const bool shown = job.wait_for_output("[rank 0] step 1 of 2 on rank 0\n");
  std::ofstream(go) << "go\n";
  int status = job.wait();
  EXPECT_TRUE(shown) << "the line came only once the rank was released";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "dp-run ended with " << exit_text(status);
  EXPECT_EQ(job.output(), "[rank 0] step 1 of 2 on rank 0\n[rank 0] step 2 of 2 on rank 0\n");
}

// Rank 0 shows progress without a newline and waits; once released, it ends
// that line and rank 1 writes a line and an unfinished one, then both exit.
TEST(DpRunOutput, ShowsAnUnfinishedLineWhileTheRankWaitsAndNeverMergesItWithAnotherRanks) {
  Job job;
  const std::string go = job.dir() + "/go";
  ASSERT_TRUE(
      job.start({"-n", "2", "sh", "-c",
                 "[ $RANK = 0 ] && printf 'progress 50%%'; for i in $(seq 3000); do [ -e " + go +
                     " ] && break; sleep 0.02; done; if [ $RANK = 0 ]; then printf ' done'; else printf 'rank 1 "
                     "line\\nrank 1 tail'; fi"},
                {}));
  const bool shown = job.wait_for_output("[rank 0] progress 50%");
  std::ofstream(go) << "go\n";
  int status = job.wait();
  EXPECT_TRUE(shown) << "the unfinished line came only once the rank was released";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "dp-run ended with " << exit_text(status);
  const std::string output = job.output();
  std::string rank0_text;
  std::vector<std::string> rank1_lines;
  for (const std::string& line : lines_of(output)) {
    if (starts_with(line, "[rank 0] ")) {
      rank0_text += line.substr(9);
    } else {
      EXPECT_TRUE(starts_with(line, "[rank 1] ")) << "a line without a rank's prefix: " << line;
      rank1_lines.push_back(line);
    }
  }
  EXPECT_EQ(rank0_text, "progress 50% done") << output;
  EXPECT_EQ(rank1_lines, (std::vector<std::string>{"[rank 1] rank 1 line", "[rank 1] rank 1 tail"})) << output;
  EXPECT_EQ(output.back(), '\n') << output;
}

// dp-run's stdout and stderr are one file here: rank 0 shows progress on
// stdout and waits; rank 1 then writes a line to stderr.
TEST(DpRunOutput, EndsAnUnfinishedStdoutLineBeforeAStderrLineOnTheSameFile) {
  Job job;
  const std::string go = job.dir() + "/go", started = job.dir() + "/started";
  ASSERT_TRUE(job.start({"-n", "2", "sh", "-c",
                         "if [ $RANK = 0 ]; then printf 'progress 50%%'; f=" + go + "; else f=" + started +
                             "; fi; for i in $(seq 3000); do [ -e $f ] && break; sleep 0.02; done; if [ $RANK = 0 "
                             "]; then echo ' done'; else echo 'rank 1 warning' >&2; fi"},
                        {}));
  const bool progress_shown = job.wait_for_output("[rank 0] progress 50%");
  std::ofstream(started) << "go\n";
  const bool warning_shown = job.wait_for_output("rank 1 warning\n");
  std::ofstream(go) << "go\n";
  int status = job.wait();
  EXPECT_TRUE(progress_shown && warning_shown) << job.output();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "dp-run ended with " << exit_text(status);
  const std::string output = job.output();
  std::string rank0_text;
  for (const std::string& line : lines_of(output)) {
    if (starts_with(line, "[rank 0] ")) {
      rank0_text += line.substr(9);
    } else {
      EXPECT_EQ(line, "[rank 1] rank 1 warning") << output;
    }
  }
  EXPECT_EQ(rank0_text, "progress 50% done") << output;
}

// Rank 0 grows a line of dots, never pausing long, until released; rank 1
// writes a line meanwhile, which must not wait for rank 0's to end.
TEST(DpRunOutput, ShowsAGrowingUnfinishedLineWithoutHoldingBackAnotherRanksLines) {
  Job job;
  const std::string go = job.dir() + "/go";
  ASSERT_TRUE(job.start({"-n", "2", "sh", "-c",
                         "if [ $RANK = 0 ]; then for i in $(seq 3000); do [ -e " + go +
                             " ] && break; printf .; sleep 0.02; done; echo end; else echo 'rank 1 line'; for i in "
                             "$(seq 3000); do [ -e " +
                             go + " ] && break; sleep 0.02; done; fi"},
                        {}));
  const bool dots_shown = job.wait_for_output("[rank 0] .");
  const bool line_shown = job.wait_for_output("[rank 1] rank 1 line\n");
  std::ofstream(go) << "go\n";
  int status = job.wait();
  EXPECT_TRUE(dots_shown) << "rank 0's unfinished line came only once the rank was released";
  EXPECT_TRUE(line_shown) << "rank 1's line waited for rank 0's to end";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "dp-run ended with " << exit_text(status);
  const std::string output = job.output();
  std::string rank0_text;
  for (const std::string& line : lines_of(output)) {
    if (starts_with(line, "[rank 0] ")) {
      rank0_text += line.substr(9);
    } else {
      EXPECT_EQ(line, "[rank 1] rank 1 line") << output;
    }
  }
  ASSERT_GE(rank0_text.size(), 4u) << output;
  EXPECT_EQ(rank0_text.substr(rank0_text.size() - 3), "end") << output;
  EXPECT_EQ(rank0_text.find_first_not_of('.'), rank0_text.size() - 3) << output;
}

// Rank 0 writes a 1 MiB line, far more than dp-run buffers, while rank 1
// writes short lines all along.
TEST(DpRunOutput, KeepsALineLongerThanItsBuffersWholeWhileAnotherRankWrites) {
  constexpr size_t kLong = size_t{1} << 20;
  Job job;
  const std::string started = job.dir() + "/started", done = job.dir() + "/done";
  ASSERT_TRUE(job.start(
      {"-n", "2", "sh", "-c",
       "if [ $RANK = 0 ]; then for i in $(seq 3000); do [ -e " + started + " ] && break; sleep 0.02; done; head -c " +
           std::to_string(kLong) + " /dev/zero | tr '\\000' x; echo; : > " + done + "; else : > " + started +
           "; i=0; until [ -e " + done + " ]; do echo \"rank 1 line $i\"; i=$((i + 1)); done; fi"},
      {}));
  int status = job.wait();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "dp-run ended with " << exit_text(status);
  std::vector<std::string> rank0_lines;
  long next = 0;
  std::vector<std::string> wrong;
  for (const std::string& line : lines_of(job.output())) {
    if (starts_with(line, "[rank 0] ")) {
      rank0_lines.push_back(line);
    } else if (line == "[rank 1] rank 1 line " + std::to_string(next)) {
      ++next;
    } else if (wrong.size() < 5) {
      wrong.push_back(line.substr(0, 200));
    }
  }
  ASSERT_EQ(rank0_lines.size(), 1u) << "rank 0's line came in pieces";
  EXPECT_EQ(rank0_lines[0], "[rank 0] " + std::string(kLong, 'x'));
  EXPECT_TRUE(wrong.empty()) << "first bad line: " << (wrong.empty() ? "" : wrong[0]);
  EXPECT_GT(next, 0) << "rank 1 wrote nothing";
}

}  // namespace
