/* One rank of the flight recorder's tests: CALLS all_reduces over the
 * launcher's group (DP_TEST_TIMEOUT_MS, default 60000), except that rank
 * HANG_RANK, before its call HANG_AT, stops itself (SIGSTOP) or pauses for
 * good; the others print "rank R entering call HANG_AT" just before theirs.
 *   trace_worker stop|pause CALLS HANG_RANK HANG_AT
 * Exits 0 after every call, 1 when one fails (printing why). */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dparallel/dparallel.h"

int main(int argc, char **argv) {
  if (argc != 5 || (strcmp(argv[1], "stop") != 0 && strcmp(argv[1], "pause") != 0)) {
    fprintf(stderr, "usage: trace_worker stop|pause CALLS HANG_RANK HANG_AT\n");
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
