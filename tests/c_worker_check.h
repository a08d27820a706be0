/* What the plain-C test workers (ddp_worker, fsdp_worker) share: one rank's
 * identity and the CHECK macros that count failures instead of stopping, so
 * that a rank reports every failed check and still takes part in the
 * collectives the others wait for. Include once per program. */
#ifndef DP_TESTS_C_WORKER_CHECK_H
#define DP_TESTS_C_WORKER_CHECK_H

#include <stdio.h>

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

#endif /* DP_TESTS_C_WORKER_CHECK_H */
