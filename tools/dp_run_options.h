// dp-run's command line, and what it sets up from it before any rank starts:
// the open-file limit, where the ranks meet and the environment they share.
#pragma once

#include <string>

namespace dprun {

inline constexpr const char* kRendezvousHelp =
    "Each rank gets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,\n"
    "MASTER_PORT, DP_STORE_ADDR and DP_STORE_PORT. dparallel's store, which rank 0 serves, is at\n"
    "DP_STORE_ADDR:DP_STORE_PORT; MASTER_PORT is another port, left to the program's own framework\n"
    "(torch.distributed's env://, say), so both can rendezvous. MASTER_ADDR and DP_STORE_ADDR are\n"
    "--master-addr (default 127.0.0.1). Without --master-port, both ports are free ones dp-run picks\n"
    "(it holds the store's until the job ends); with --master-port P, MASTER_PORT is P and the store\n"
    "is at P + 1, or at --store-port S, so every node of a job derives the same ports. On a single\n"
    "node without one, dp-run makes a fresh DP_STORE_TOKEN; on several, each node passes on its own\n"
    "environment's, which must be the same on all.\n";

// What the command line asks for.
struct Options {
  long nproc = -1, nnodes = 1, node_rank = 0, grace_ms = 5000;
  std::string master_addr;
  long master_port = -1;          // the host framework's (MASTER_PORT)
  long store_port = -1;           // dparallel's store (DP_STORE_PORT)
  std::string trace_dir;          // --trace-dir: the ranks' DP_TRACE_DIR; SIGUSR1 then asks for dumps
  long max_restarts = 0;          // --max-restarts: how often a failed job starts again
  bool survive_failures = false;  // --survive-failures: a failed rank does not stop the others
  char** program = nullptr;       // the ranks' program and its arguments, null-terminated
};

// The options and the ranks' program; --help prints the usage and exits 0,
// a usage error says why and exits 2.
Options parse_args(int argc, char** argv);
// Two pipes per rank stay open: past the open-file limit, ranks would start and then be killed.
void raise_open_file_limit(long nproc);
// Where the ranks meet (the master's address, its port and the store's,
// the store's token; kRendezvousHelp), and the environment every rank shares.
void set_up_rendezvous(Options& o);

}  // namespace dprun
