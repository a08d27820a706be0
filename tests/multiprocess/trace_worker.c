/* One rank of the flight recorder's and the abort's tests, over the
 * launcher's group (DP_TEST_TIMEOUT_MS, default 60000).
 *   trace_worker stop|pause CALLS HANG_RANK HANG_AT
 *       CALLS all_reduces, except that rank HANG_RANK, before its call
 *       HANG_AT, stops itself (SIGSTOP) or pauses for good; the others
 *       print "rank R entering call HANG_AT" just before theirs. Exits 0
 *       after every call, 1 when one fails (printing why).
 *   trace_worker abort running|between
 *       2 ranks, rank 1 calling only once rank 0 is done. running: rank
 *       0's all_reduce waits for rank 1 while another thread of rank 0
 *       aborts the group; between: rank 0 aborts between calls. Rank 0's
 *       calls after the abort (and, running, the one it interrupted) fail
 *       with DP_ESTATE naming it; then rank 0 makes DP_TEST_DIR/aborted and
 *       rank 1's next call fails rather than waits (running: its first one
 *       may instead complete the call rank 0 had already joined). Each
 *       prints "rank R: abort passed" when its checks held (exit 0; else 1). */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dparallel/dparallel.h"

static double seconds_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void *abort_soon(void *pg) {
  /* Not a synchronisation: the call fails alike whether it is running or
   * not yet started; the pause makes the first the likely case. */
  struct timespec pause_for = {0, 200 * 1000 * 1000};
  nanosleep(&pause_for, NULL);
  if (dp_process_group_abort((dp_process_group *)pg) != DP_OK) printf("the abort failed: %s\n", dp_last_error());
  return NULL;
}

/* DP_ESTATE naming the abort, within half of the 120 s timeout. */
static int failed_as_aborted(int rank, const char *what, dp_status st, double started) {
  const double took = seconds_now() - started;
  printf("rank %d: %s: status %d after %.1f s: %s\n", rank, what, (int)st, took, dp_last_error());
  return st == DP_ESTATE && strstr(dp_last_error(), "aborted") != NULL && took < 60;
}

static int abort_scenario(dp_process_group *pg, dp_tensor *t, int running) {
  const int rank = dp_process_group_rank(pg);
  const char *dir = getenv("DP_TEST_DIR");
  char flag[4096];
  snprintf(flag, sizeof flag, "%s/aborted", dir != NULL ? dir : ".");
  int ok = 1;
  if (rank == 0) {
    double started = seconds_now();
    if (running) {
      pthread_t aborter;
      if (pthread_create(&aborter, NULL, abort_soon, pg) != 0) return 0;
      ok &= failed_as_aborted(rank, "the all_reduce in flight", dp_pg_all_reduce(pg, t, DP_SUM), started);
      pthread_join(aborter, NULL);
    } else {
      ok &= dp_process_group_abort(pg) == DP_OK;
    }
    started = seconds_now();
    ok &= failed_as_aborted(rank, "the next all_reduce", dp_pg_all_reduce(pg, t, DP_SUM), started);
    ok &= dp_process_group_abort(pg) == DP_OK; /* again: nothing more to do */
    FILE *f = fopen(flag, "w");
    if (f != NULL) fclose(f);
  } else {
    for (int i = 0; i < 12000 && access(flag, F_OK) != 0; ++i) usleep(10000);
    for (int call = 0; call < 2; ++call) {
      const double started = seconds_now();
      const dp_status st = dp_pg_all_reduce(pg, t, DP_SUM);
      const double took = seconds_now() - started;
      printf("rank %d: the peer's all_reduce %d: status %d after %.1f s: %s\n", rank, call, (int)st, took,
             st == DP_OK ? "" : dp_last_error());
      ok &= took < 60;
      /* Shared memory: rank 0's interrupted call had already put its part in. */
      if (call == 0 && running && st == DP_OK) continue;
      ok &= st != DP_OK;
      break;
    }
  }
  ok &= dp_process_group_abort(NULL) == DP_EINVAL && strstr(dp_last_error(), "'pg'") != NULL;
  return ok;
}

int main(int argc, char **argv) {
  if (argc == 3 && strcmp(argv[1], "abort") == 0) {
    setvbuf(stdout, NULL, _IOLBF, 0);
    dp_process_group_options o = DP_PROCESS_GROUP_OPTIONS_INIT;
    o.timeout_ms = 120000;
    dp_process_group *pg = NULL;
    int64_t n = 1000;
    static float zeros[1000];
    dp_tensor *t = NULL;
    if (dp_process_group_create_from_env(&pg, &o) != DP_OK ||
        dp_tensor_create(&t, DP_FLOAT32, 1, &n, (dp_device){DP_DEVICE_CPU, 0}) != DP_OK ||
        dp_tensor_copy_from_host(t, zeros, sizeof zeros) != DP_OK) {
      printf("setting up failed: %s\n", dp_last_error());
      return 1;
    }
    const int ok = abort_scenario(pg, t, strcmp(argv[2], "running") == 0);
    printf("rank %d: abort %s\n", dp_process_group_rank(pg), ok ? "passed" : "FAILED");
    dp_tensor_destroy(t);
    dp_process_group_destroy(pg);
    return ok ? 0 : 1;
  }
  if (argc != 5 || (strcmp(argv[1], "stop") != 0 && strcmp(argv[1], "pause") != 0)) {
    fprintf(stderr, "usage: trace_worker stop|pause CALLS HANG_RANK HANG_AT | trace_worker abort running|between\n");
    return 2;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  const int calls = atoi(argv[2]), hang_rank = atoi(argv[3]), hang_at = atoi(argv[4]);
  const char *timeout = getenv("DP_TEST_TIMEOUT_MS");
  dp_process_group_options o = DP_PROCESS_GROUP_OPTIONS_INIT;
  o.timeout_ms = timeout != NULL ? atoi(timeout) : 60000;
  dp_process_group *pg = NULL;
  if (dp_process_group_create_from_env(&pg, &o) != DP_OK) {
    printf("creating the group failed: %s\n", dp_last_error());
    return 1;
  }
  const int rank = dp_process_group_rank(pg);
  int64_t n = 1000;
  dp_tensor *t = NULL;
  static float zeros[1000];
  if (dp_tensor_create(&t, DP_FLOAT32, 1, &n, (dp_device){DP_DEVICE_CPU, 0}) != DP_OK ||
      dp_tensor_copy_from_host(t, zeros, sizeof zeros) != DP_OK) {
    return 1;
  }
  for (int i = 0; i < calls; ++i) {
    if (i == hang_at) {
      if (rank == hang_rank) {
        printf("rank %d %s\n", rank, argv[1][0] == 's' ? "stopping" : "pausing");
        if (argv[1][0] == 's') {
          raise(SIGSTOP);
        } else {
          for (;;) pause();
        }
      } else {
        printf("rank %d entering call %d\n", rank, i);
      }
    }
    if (dp_pg_all_reduce(pg, t, DP_SUM) != DP_OK) {
      printf("rank %d: call %d failed: %s\n", rank, i, dp_last_error());
      return 1;
    }
  }
  dp_tensor_destroy(t);
  dp_process_group_destroy(pg);
  printf("rank %d finished\n", rank);
  return 0;
}
