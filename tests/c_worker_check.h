/* What the plain-C test workers (ddp_worker, fsdp_worker) share: one rank's
 * identity, the CHECK macros that count failures instead of stopping, so
 * that a rank reports every failed check and still takes part in the
 * collectives the others wait for, and the backend the test runs them over.
 * Include once per program (C or C++). */
#ifndef DP_TESTS_C_WORKER_CHECK_H
#define DP_TESTS_C_WORKER_CHECK_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dparallel/dparallel.h"

static int g_rank = -1;
static int g_world = 0;
static int g_failures = 0;
static const char *g_dir = "/tmp";

#define CHECK(cond, ...)                                                                  \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      fprintf(stderr, "rank %d: check failed at line %d: %s: ", g_rank, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                                       \
      fprintf(stderr, "\n");                                                              \
      ++g_failures;                                                                       \
    }                                                                                     \
  } while (0)

#define CHECK_OK(expr)                                                                                  \
  do {                                                                                                  \
    dp_status st_ = (expr);                                                                             \
    if (st_ != DP_OK) {                                                                                 \
      fprintf(stderr, "rank %d: line %d: %s returned %d (%s): %s\n", g_rank, __LINE__, #expr, (int)st_, \
              dp_status_string(st_), dp_last_error());                                                  \
      ++g_failures;                                                                                     \
    }                                                                                                   \
  } while (0)

/* The dp_backend the test asks this rank's group for (DP_TEST_GROUP_BACKEND,
 * tests/backends.h rank_env), or `otherwise`. */
static inline int32_t test_group_backend(int32_t otherwise) {
  const char *asked = getenv("DP_TEST_GROUP_BACKEND");
  return asked != NULL ? (int32_t)atoi(asked) : otherwise;
}

/* Checks that `pg` runs over the backend the test named
 * (DP_TEST_GROUP_REPORTS), where it named one. */
static inline void check_test_group_backend(dp_process_group *pg) {
  const char *reports = getenv("DP_TEST_GROUP_REPORTS");
  CHECK(reports == NULL || strcmp(dp_process_group_backend(pg), reports) == 0, "the group runs over %s, not %s",
        dp_process_group_backend(pg), reports);
}

#endif /* DP_TESTS_C_WORKER_CHECK_H */
