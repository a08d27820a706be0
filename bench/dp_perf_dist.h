// dp-perf across ranks: collectives of a process group made from the
// launcher's environment (run it under dp-run), nccl-tests columns.
#pragma once

// `op` is all_reduce, broadcast, all_gather or reduce_scatter; argv holds the
// options after it (argv[0] is the program name). Returns the exit code.
int dp_perf_dist_main(const char* op, int argc, char** argv);
