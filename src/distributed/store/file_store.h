// A store in one file on a shared filesystem: an append-only log of records
// (a tombstone record erases a key), read and appended under flock. The last
// of `world_size` users removes it.
#pragma once

#include <map>
#include <mutex>

#include "distributed/store/store.h"

namespace dparallel::dist {

class FileStore : public Store {
 public:
  FileStore(const std::string& path, int32_t world_size);
  ~FileStore() override;
  FileStore(const FileStore&) = delete;
  FileStore& operator=(const FileStore&) = delete;

  void set(const std::string& key, const Bytes& value) override;
  Bytes get(const std::string& key, Millis timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  bool erase(const std::string& key) override;
  int64_t num_keys() override;  // the store's own bookkeeping key included

 private:
  class Locked;
  Millis lock_timeout() const;  // the store's timeout, capped by the call's deadline
  void refresh(int fd);         // reads records appended since the last refresh
  // A record of `value`; none (`value` null) is a tombstone: the key is erased.
  void append(int fd, const std::string& key, const Bytes* value);

  std::string path_;
  int32_t world_size_;
  std::mutex mutex_;
  std::map<std::string, Bytes> cache_;
  off_t read_offset_ = 0;
};

}  // namespace dparallel::dist
