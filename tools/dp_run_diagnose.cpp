// dp-run --diagnose DIR: reads the flight recorder's dumps (DP_TRACE_DIR,
// one JSON file per rank; src/distributed/flight_recorder.h) and says, for
// each process group, where each rank is, which ranks are behind and on
// which call, and the first collective the ranks called differently.
#include "dp_run_diagnose.h"

#include <dirent.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace dprun {
namespace {

using nlohmann::json;

struct Call {
  uint64_t seq = 0;
  std::string call, state, dtype, op, caller;
  int64_t numel = -1, root = -1, started_us = 0, issued_us = 0;
};

// One rank's view of one group.
struct RankTrace {
  std::string file;
  long process_rank = -1;  // RANK of the process that wrote it
  int64_t dumped_us = 0;
  std::string reason;
  std::vector<Call> calls;
};

struct Group {
  std::string id, backend;
  int size = 0;
  std::map<int, RankTrace> ranks;  // by the rank in the group
};

std::string describe(const Call& c) {
  std::ostringstream s;
  s << "#" << c.seq << " " << c.call;
  if (!c.dtype.empty() && c.dtype != "none") s << " " << c.dtype << " x " << c.numel;
  if (c.call == "all_reduce" || c.call == "reduce_scatter") s << " (" << c.op << ")";
  if (c.root >= 0) s << " root " << c.root;
  if (!c.caller.empty() && c.caller != "the host's own call") s << ", " << c.caller;
  return s.str();
}

// What makes two ranks' calls of one collective number the same call.
std::string signature(const Call& c) {
  return c.call + "|" + c.dtype + "|" + std::to_string(c.numel) + "|" + c.op + "|" + std::to_string(c.root) + "|" +
         c.caller;
}

std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size(); ++i) out += (i == 0 ? "" : ", ") + std::to_string(ranks[i]);
  return (ranks.size() == 1 ? "rank " : "ranks ") + out;
}

bool read_dump(const std::string& path, std::map<std::string, Group>& groups, std::string& problem) {
  std::ifstream in(path);
  json dump;
  try {
    in >> dump;
    if (dump.value("format", "") != "dparallel-trace-1") {
      problem = "not a dparallel trace";
      return false;
    }
    RankTrace base;
    base.file = path;
    base.process_rank = dump["rank"].is_number() ? dump["rank"].get<long>() : -1;
    base.dumped_us = dump.value("time_us", int64_t{0});
    base.reason = dump.value("reason", "");
    for (const json& g : dump.at("groups")) {
      const std::string id = g.at("group").get<std::string>();
      const int size = g.at("size").get<int>();
      const int rank = g.at("rank").get<int>();
      if (size <= 0 || rank < 0 || rank >= size) continue;
      Group& group = groups[id + "\n" + std::to_string(size)];
      group.id = id;
      group.size = size;
      group.backend = g.value("backend", "");
      RankTrace trace = base;
      for (const json& c : g.at("calls")) {
        Call call;
        call.seq = c.value("seq", uint64_t{0});
        call.call = c.value("call", "");
        call.state = c.value("state", "");
        call.dtype = c.value("dtype", "");
        call.op = c.value("op", "");
        call.caller = c.value("caller", "");
        call.numel = c.value("numel", int64_t{-1});
        call.root = c.value("root", int64_t{-1});
        call.started_us = c.value("started_us", int64_t{0});
        call.issued_us = c.value("issued_us", int64_t{0});
        trace.calls.push_back(std::move(call));
      }
      group.ranks[rank] = std::move(trace);
    }
  } catch (const std::exception& e) {
    problem = e.what();
    return false;
  }
  return true;
}

// The highest collective number a rank has reached (started or finished).
uint64_t progress(const RankTrace& t) {
  uint64_t seq = 0;
  for (const Call& c : t.calls) seq = std::max(seq, c.seq);
  return seq;
}

const Call* call_of(const RankTrace& t, uint64_t seq) {
  for (const Call& c : t.calls) {
    if (c.seq == seq) return &c;
  }
  return nullptr;
}

void diagnose_group(const Group& g) {
  std::printf("group %s (%d ranks, %s):\n", g.id.c_str(), g.size, g.backend.c_str());
  std::vector<int> missing;
  uint64_t front = 0;
  for (int r = 0; r < g.size; ++r) {
    auto it = g.ranks.find(r);
    if (it == g.ranks.end()) {
      missing.push_back(r);
      std::printf("  rank %d: no dump (stopped, dead, or run without DP_TRACE_DIR)\n", r);
      continue;
    }
    const RankTrace& t = it->second;
    front = std::max(front, progress(t));
    std::string where = "no collective yet";
    const Call* last_done = nullptr;
    const Call* in_flight = nullptr;
    for (const Call& c : t.calls) {
      if (c.seq != 0 && (c.state == "done" || c.state == "failed")) last_done = &c;
      if (c.state == "started" || (c.state == "failed" && c.seq == progress(t))) in_flight = &c;
    }
    std::printf(
        "  rank %d%s: ", r,
        t.process_rank >= 0 && t.process_rank != r ? (" (RANK " + std::to_string(t.process_rank) + ")").c_str() : "");
    if (in_flight != nullptr) {
      const double waited = in_flight->started_us > 0 ? (t.dumped_us - in_flight->started_us) / 1e6 : 0;
      std::printf("in %s, %s %.1f s before the dump", describe(*in_flight).c_str(), in_flight->state.c_str(), waited);
    } else if (last_done != nullptr) {
      std::printf("idle after %s, %s", describe(*last_done).c_str(), last_done->state.c_str());
    } else {
      std::printf("%s", where.c_str());
    }
    std::printf("; dumped on %s\n", t.reason.substr(0, 160).c_str());
  }
  // Behind: a rank whose latest collective is older than another's.
  std::vector<int> behind, ahead;
  for (const auto& [r, t] : g.ranks) (progress(t) < front ? behind : ahead).push_back(r);
  const Call* waited_on = nullptr;
  for (int r : ahead) {
    if ((waited_on = call_of(g.ranks.at(r), front)) != nullptr) break;
  }
  if (!behind.empty() || (!missing.empty() && !g.ranks.empty())) {
    std::vector<int> all_behind = behind;
    all_behind.insert(all_behind.end(), missing.begin(), missing.end());
    std::sort(all_behind.begin(), all_behind.end());
    std::printf("  behind: %s: %s reached %s", rank_list(all_behind).c_str(), rank_list(ahead).c_str(),
                waited_on != nullptr ? describe(*waited_on).c_str() : ("#" + std::to_string(front)).c_str());
    for (int r : behind) {
      const uint64_t at = progress(g.ranks.at(r));
      const Call* last = call_of(g.ranks.at(r), at);
      std::printf("; rank %d is at %s", r, last != nullptr ? describe(*last).c_str() : "no collective yet");
    }
    if (!missing.empty()) std::printf("; %s left no dump", rank_list(missing).c_str());
    std::printf("\n");
  } else if (!g.ranks.empty()) {
    std::printf("  no rank behind: every rank reached collective #%llu\n", static_cast<unsigned long long>(front));
  }
  // The first collective number whose calls differ between the ranks that recorded it.
  std::set<uint64_t> seqs;
  for (const auto& [r, t] : g.ranks) {
    for (const Call& c : t.calls) {
      if (c.seq != 0) seqs.insert(c.seq);
    }
  }
  for (uint64_t seq : seqs) {
    std::map<std::string, std::vector<int>> by_call;
    std::map<std::string, const Call*> example;
    for (const auto& [r, t] : g.ranks) {
      if (const Call* c = call_of(t, seq)) {
        by_call[signature(*c)].push_back(r);
        example[signature(*c)] = c;
      }
    }
    if (by_call.size() < 2) continue;
    std::printf("  first call to differ: collective #%llu:", static_cast<unsigned long long>(seq));
    const char* separator = " ";
    for (const auto& [sig, ranks] : by_call) {
      std::printf("%s%s called %s", separator, rank_list(ranks).c_str(), describe(*example[sig]).c_str());
      separator = "; ";
    }
    std::printf("\n");
    return;
  }
}

}  // namespace

int diagnose_main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: dp-run --diagnose DIR (the DP_TRACE_DIR the ranks wrote their dumps to)\n");
    return 2;
  }
  const std::string dir = argv[2];
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    std::fprintf(stderr, "dp-run --diagnose: cannot read the folder %s\n", dir.c_str());
    return 2;
  }
  std::vector<std::string> files;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name.size() > 5 && name.compare(name.size() - 5, 5, ".json") == 0) files.push_back(dir + "/" + name);
  }
  ::closedir(d);
  std::sort(files.begin(), files.end());
  std::map<std::string, Group> groups;
  size_t read = 0;
  for (const std::string& file : files) {
    std::string problem;
    if (read_dump(file, groups, problem)) {
      ++read;
    } else {
      std::fprintf(stderr, "dp-run --diagnose: skipped %s: %s\n", file.c_str(), problem.c_str());
    }
  }
  if (read == 0) {
    std::fprintf(stderr, "dp-run --diagnose: no trace in %s (the ranks write them with DP_TRACE_DIR set)\n",
                 dir.c_str());
    return 1;
  }
  std::printf("%zu dump(s) in %s\n", read, dir.c_str());
  for (const auto& [key, group] : groups) diagnose_group(group);
  return 0;
}

}  // namespace dprun
