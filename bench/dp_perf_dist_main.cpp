// dp-perf-dist: the multi-rank dp-perf on its own. Run it under dp-run:
//   dp-run -n 2 dp-perf-dist all_reduce -b 4K -e 64M -f 4
#include <cstdio>

#include "dp_perf_dist.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: dp-perf-dist all_reduce|broadcast|all_gather|reduce_scatter [-b 4K] [-e 64M] [-f 4] "
                 "[-t float] [-o sum] [-r 0] [-n ops] [-s 21] [-w warmup] [-c 1]\n");
    return 2;
  }
  return dp_perf_dist_main(argv[1], argc - 1, argv + 1);
}
