// Ranks as threads of the test process, each with its own process group
// over one file store: real collectives, and the test sees every rank's
// results.
#pragma once

#include <unistd.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "group_util.h"
#include "module/module_test_util.h"
#include "test_util.h"

namespace dptest {

struct RankOptions {
  int32_t backend = DP_BACKEND_AUTO;
  int timeout_ms = 60000;
  bool cuda = false;  // rank r's group on cuda:r
};

// Runs body(rank, group) on `world` threads and joins them; `prefix` keeps
// each suite's store file apart.
inline void run_thread_ranks(const std::string& prefix, int world, const RankOptions& options,
                             const std::function<void(int, dp_process_group*)>& body) {
  std::string path = temp_path(prefix, std::to_string(world) + "_store");
  ::unlink(path.c_str());
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      GroupPtr pg = file_store_group(
          path, r, world, GroupOptions{options.backend, options.timeout_ms, options.cuda ? cuda(r) : cpu(0)});
      ASSERT_NE(pg, nullptr);
      body(r, pg.get());
    });
  }
  for (auto& t : ranks) t.join();
  ::unlink(path.c_str());
}

}  // namespace dptest
