#include "dp_run_options.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>

#include "dp_run_output.h"

namespace dprun {

namespace {

constexpr const char* kUsage =
    "usage: dp-run -n N [--nnodes M --node-rank K] [--master-addr A] [--master-port P] [--store-port S]\n"
    "              [--grace-ms G] [--trace-dir D] [--max-restarts K | --survive-failures] prog [args...]\n"
    "       dp-run --diagnose DIR   (the ranks' flight recorder dumps, written to DP_TRACE_DIR)\n"
    "--max-restarts K: when a rank fails, the others are stopped and the job starts again, up to K\n"
    "times (one node only); every run's ranks get DP_RESTART_COUNT, 0 for the first.\n"
    "--survive-failures: a rank that fails does not stop the others, which may go on without it\n"
    "(dp_process_group_shrink); dp-run exits 0 when a rank outlived the first failure and every\n"
    "one that did exited 0, else with the first failure's code.\n";

[[noreturn]] void usage(const char* message) {
  std::fprintf(stderr, "dp-run: %s\n%s", message, kUsage);
  std::exit(2);
}

long parse_int(const char* text, const char* flag, long min, long max) {
  char* end = nullptr;
  errno = 0;
  long v = std::strtol(text, &end, 10);
  if (errno != 0 || *end != '\0' || v < min || v > max) {
    std::string msg = std::string(flag) + " takes an integer in " + std::to_string(min) + ".." + std::to_string(max) +
                      ", not '" + text + "'";
    usage(msg.c_str());
  }
  return v;
}

// A free port on `addr`, held by the returned socket (bound, not listening,
// SO_REUSEADDR) for dp-run's whole life: rank 0 can still listen on it, but
// no other program gets it meanwhile. -1 when none.
int hold_free_port(const std::string& addr, long* port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* info = nullptr;
  if (getaddrinfo(addr.c_str(), "0", &hints, &info) != 0) return -1;
  int held = -1;
  for (addrinfo* ai = info; ai != nullptr && held < 0; ai = ai->ai_next) {
    int fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_storage bound{};
    socklen_t len = sizeof(bound);
    if (::bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &len) == 0) {
      *port = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                                : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
      held = fd;
    } else {
      ::close(fd);
    }
  }
  freeaddrinfo(info);
  return held;
}

std::string random_token() {
  std::random_device rd;
  char buf[33];
  for (size_t i = 0; i < 4; ++i) std::snprintf(buf + 8 * i, 9, "%08x", rd());
  return buf;
}

}  // namespace

Options parse_args(int argc, char** argv) {
  Options o;
  int i = 1;
  for (; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* flag) -> const char* {
      if (i + 1 >= argc) usage((std::string(flag) + " needs a value").c_str());
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      std::printf("%s\n%s\n%s", kUsage, kRendezvousHelp, kOutputHelp);
      std::exit(0);
    }
    if (a == "-n" || a == "--nproc-per-node")
      o.nproc = parse_int(value("-n"), "-n", 1, 4096);
    else if (a == "--nnodes")
      o.nnodes = parse_int(value("--nnodes"), "--nnodes", 1, 100000);
    else if (a == "--node-rank")
      o.node_rank = parse_int(value("--node-rank"), "--node-rank", 0, 99999);
    else if (a == "--master-addr")
      o.master_addr = value("--master-addr");
    else if (a == "--master-port")
      o.master_port = parse_int(value("--master-port"), "--master-port", 1, 65535);
    else if (a == "--store-port")
      o.store_port = parse_int(value("--store-port"), "--store-port", 1, 65535);
    else if (a == "--trace-dir")
      o.trace_dir = value("--trace-dir");
    else if (a == "--grace-ms")
      o.grace_ms = parse_int(value("--grace-ms"), "--grace-ms", 0, 3600000);
    else if (a == "--survive-failures")
      o.survive_failures = true;
    else if (a == "--max-restarts")
      o.max_restarts = parse_int(value("--max-restarts"), "--max-restarts", 0, 1000000);
    else if (a == "--") {
      ++i;
      break;
    } else if (!a.empty() && a[0] == '-')
      usage(("unknown option " + a).c_str());
    else
      break;
  }
  if (o.nproc < 0) usage("-n is required");
  if (!o.trace_dir.empty()) {
    if (::mkdir(o.trace_dir.c_str(), 0755) != 0 && errno != EEXIST) {
      usage(("--trace-dir: cannot make " + o.trace_dir + ": " + std::strerror(errno)).c_str());
    }
    setenv("DP_TRACE_DIR", o.trace_dir.c_str(), 1);
  }
  if (i >= argc) usage("no program given");
  o.program = argv + i;
  return o;
}

void raise_open_file_limit(long nproc) {
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) != 0) return;
  const rlim_t needed = 2 * static_cast<rlim_t>(nproc) + 16;
  if (files.rlim_cur < needed && files.rlim_max >= needed) {
    files.rlim_cur = needed;
    ::setrlimit(RLIMIT_NOFILE, &files);
  }
  if (files.rlim_cur < needed) {
    usage(("-n " + std::to_string(nproc) + " needs " + std::to_string(needed) + " open files; the limit is " +
           std::to_string(files.rlim_cur))
              .c_str());
  }
}

void set_up_rendezvous(Options& o) {
  if (o.node_rank >= o.nnodes) usage("--node-rank must be below --nnodes");
  if (o.max_restarts > 0 && o.survive_failures) {
    usage("--max-restarts and --survive-failures exclude each other: a failure either restarts the job or not");
  }
  if (o.max_restarts > 0 && o.nnodes > 1) {
    usage(
        "--max-restarts needs a job of one node (--nnodes 1): across nodes every node's dp-run would have to "
        "restart in step, which dp-run does not arrange");
  }
  if (o.nnodes > 1 && (o.master_addr.empty() || o.master_port < 0)) {
    usage(
        "with --nnodes > 1, --master-addr and --master-port are required (node 0 serves the store there, at "
        "--store-port or the master port + 1)");
  }
  if (o.master_addr.empty()) o.master_addr = "127.0.0.1";
  // The store's port: derived from --master-port, so that every node agrees on it.
  if (o.store_port < 0 && o.master_port == 65535) {
    usage("--master-port 65535 leaves no port for the store (the master port + 1); give --store-port");
  }
  if (o.store_port < 0 && o.master_port > 0) o.store_port = o.master_port + 1;
  if (o.store_port < 0 && hold_free_port(o.master_addr, &o.store_port) < 0) {
    usage(("cannot find a free port on " + o.master_addr).c_str());
  }
  if (o.store_port == o.master_port) usage("--store-port must differ from --master-port");
  // The host framework's port: a free one, not held (the framework binds it
  // as it likes), other than the store's (held, or given).
  for (int tries = 0; o.master_port < 0 || o.master_port == o.store_port; ++tries) {
    const int probe = tries < 100 ? hold_free_port(o.master_addr, &o.master_port) : -1;
    if (probe < 0) usage(("cannot find a second free port on " + o.master_addr).c_str());
    ::close(probe);
  }
  if (o.nnodes == 1 && std::getenv("DP_STORE_TOKEN") == nullptr) setenv("DP_STORE_TOKEN", random_token().c_str(), 1);
  // Line-buffered stdout for programs linked against libdparallel, which
  // honours this. Not stdbuf's LD_PRELOAD: that breaks sanitized programs
  // (their runtime must load first), static ones and programs that run
  // others; nor a pseudo-terminal, which changes more than buffering.
  setenv("DP_LINE_BUFFERED_STDOUT", "1", 0);
}

}  // namespace dprun
