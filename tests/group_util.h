// Process groups a test makes in its own process, each rank over one file
// store: the one-rank group the single-process suites run on, and a rank of
// a group whose other ranks are threads (thread_ranks.h).
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <utility>

#include "test_util.h"

namespace dptest {

struct GroupDeleter {
  void operator()(dp_process_group* g) const { dp_process_group_destroy(g); }
};
using GroupPtr = std::unique_ptr<dp_process_group, GroupDeleter>;

// What a test's group differs in.
struct GroupOptions {
  int32_t backend = DP_BACKEND_AUTO;
  int timeout_ms = 60000;
  dp_device device = cpu(0);
};

// Rank `rank` of a `world`-rank group over the file store at `path`; null
// (the failure reported) when the create fails.
inline GroupPtr file_store_group(const std::string& path, int rank, int world, const GroupOptions& options) {
  dp_store* store = nullptr;
  EXPECT_EQ(dp_store_create_file(&store, path.c_str(), world), DP_OK) << dp_last_error();
  if (store == nullptr) return nullptr;
  dp_process_group_options o = DP_PROCESS_GROUP_OPTIONS_INIT;
  o.rank = rank;
  o.world_size = world;
  o.store = store;
  o.timeout_ms = options.timeout_ms;
  o.backend = options.backend;
  o.device = options.device;
  dp_process_group* pg = nullptr;
  EXPECT_EQ(dp_process_group_create(&pg, &o), DP_OK) << dp_last_error();
  dp_store_destroy(store);  // the group holds its own reference
  return GroupPtr(pg);
}

// A path no other store uses, in the test temp folder (the store makes the file).
inline std::string fresh_store_path() {
  std::string path = ::testing::TempDir() + "dp_store_XXXXXX";
  const int fd = ::mkstemp(path.data());
  if (fd >= 0) ::close(fd);
  ::unlink(path.c_str());
  return path;
}

// A one-rank group over a file store of its own, removed with the group.
class SingleRankGroup {
 public:
  explicit SingleRankGroup(const GroupOptions& options = {})
      : path_(fresh_store_path()), pg_(file_store_group(path_, 0, 1, options)) {}
  ~SingleRankGroup() {
    pg_.reset();
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  SingleRankGroup(SingleRankGroup&& other) noexcept : path_(std::move(other.path_)), pg_(std::move(other.pg_)) {
    other.path_.clear();
  }
  SingleRankGroup& operator=(SingleRankGroup&& other) noexcept {
    if (this != &other) {
      pg_.reset();
      if (!path_.empty()) ::unlink(path_.c_str());
      path_ = std::move(other.path_);
      pg_ = std::move(other.pg_);
      other.path_.clear();
    }
    return *this;
  }
  SingleRankGroup(const SingleRankGroup&) = delete;
  SingleRankGroup& operator=(const SingleRankGroup&) = delete;

  dp_process_group* get() const { return pg_.get(); }

 private:
  std::string path_;
  GroupPtr pg_;
};

}  // namespace dptest
