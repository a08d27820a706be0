// Ranks as threads of the test process, each with its own process group
// over one file store: real collectives, and the test sees every rank's
// results.
#pragma once

#include <unistd.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

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
      dp_store* store = nullptr;
      ASSERT_EQ(dp_store_create_file(&store, path.c_str(), world), DP_OK) << dp_last_error();
      dp_process_group_options o = DP_PROCESS_GROUP_OPTIONS_INIT;
      o.rank = r;
      o.world_size = world;
      o.store = store;
      o.timeout_ms = options.timeout_ms;
      o.backend = options.backend;
      if (options.cuda) o.device = cuda(r);
      dp_process_group* pg = nullptr;
      dp_status st = dp_process_group_create(&pg, &o);
      dp_store_destroy(store);
      ASSERT_EQ(st, DP_OK) << dp_last_error();
      body(r, pg);
      dp_process_group_destroy(pg);
    });
  }
  for (auto& t : ranks) t.join();
  ::unlink(path.c_str());
}

}  // namespace dptest
