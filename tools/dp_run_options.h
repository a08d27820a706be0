// dp-run's command line, and what it sets up from it before any rank starts:
// the open-file limit, where the ranks meet and the environment they share.
#pragma once

#include <string>

namespace dprun {

// What the command line asks for.
struct Options {
  long nproc = -1, nnodes = 1, node_rank = 0, grace_ms = 5000;
  std::string master_addr;
  long master_port = -1;
  char** program = nullptr;  // the ranks' program and its arguments, null-terminated
};

// The options and the ranks' program; --help prints the usage and exits 0,
// a usage error says why and exits 2.
Options parse_args(int argc, char** argv);
// Two pipes per rank stay open: past the open-file limit, ranks would start and then be killed.
void raise_open_file_limit(long nproc);
// Where the ranks meet (the master's address and port, the store's token),
// and the environment every rank shares.
void set_up_rendezvous(Options& o);

}  // namespace dprun
