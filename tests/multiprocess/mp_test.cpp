// What is particular to Gloo across processes: its sockets carry only
// initialised bytes. The collectives themselves, on every backend, are the
// conformance suite's (tests/conformance).
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <vector>

#include "conformance/ranks.h"

namespace {

// Nothing uninitialised goes out over a socket: not Gloo's addresses through
// the store at setup, nor the bytes of its ring all-gathers.
TEST(Gloo, NoUninitialisedBytesGoOutOverSocketsUnderValgrind) {
#if defined(__SANITIZE_ADDRESS__) || !defined(DP_VALGRIND)
  GTEST_SKIP() << "needs valgrind and a build without AddressSanitizer";
#else
  dptest::Ranks run;
  run.program = DP_CONFORMANCE_WORKER;
  run.arguments = "mismatch";
  run.limit = std::chrono::seconds(240);
  run.env[-1] = {"DP_TEST_BACKEND=gloo"};
  run.wrapper = {DP_VALGRIND, "--error-exitcode=99", "--track-origins=yes", "-q"};
  std::vector<dptest::RankExit> results = dptest::run_ranks(run);
  dptest::expect_all_passed(results);
  for (const dptest::RankExit& r : results) EXPECT_EQ(r.output.find("uninitialised"), std::string::npos) << r.output;
#endif
}

}  // namespace
