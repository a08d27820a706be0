// The shared-memory segment: private to its creator's user, never reused,
// and gone from /dev/shm once unlinked while its mappings stay usable.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <set>
#include <string>

#include "core/error.h"
#include "distributed/shm/segment.h"
#include "distributed/shm/shm_process_group.h"

namespace dparallel::dist {
namespace {

bool exists(const std::string& name) {
  struct stat st {};
  return ::stat(("/dev/shm" + name).c_str(), &st) == 0;
}

TEST(ShmSegment, NamesAreRandomHexUnderOnePrefix) {
  std::set<std::string> names;
  for (int i = 0; i < 100; ++i) {
    std::string name = ShmSegment::random_name();
    ASSERT_EQ(name.rfind("/dparallel-", 0), 0u) << name;
    ASSERT_EQ(name.size(), 11u + 32u) << name;
    EXPECT_EQ(name.find_first_not_of("0123456789abcdef", 11), std::string::npos) << name;
    names.insert(name);
  }
  EXPECT_EQ(names.size(), 100u);
}

TEST(ShmSegment, CreatedMode0600AndSharedWithAttachedMappings) {
  std::string name = ShmSegment::random_name();
  ShmSegment created = ShmSegment::create(name, 8192);
  struct stat st {};
  ASSERT_EQ(::stat(("/dev/shm" + name).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  EXPECT_EQ(st.st_uid, ::geteuid());
  ShmSegment attached = ShmSegment::attach(name, 8192);
  ShmSegment::unlink(name);
  EXPECT_FALSE(exists(name));
  std::memcpy(created.data() + 100, "hello", 5);
  EXPECT_EQ(std::memcmp(attached.data() + 100, "hello", 5), 0);
  EXPECT_EQ(attached.data()[8191], 0);
}

TEST(ShmSegment, CreateRefusesANameThatExists) {
  std::string name = ShmSegment::random_name();
  ShmSegment first = ShmSegment::create(name, 4096);
  try {
    ShmSegment::create(name, 4096);
    ADD_FAILURE() << "a second create of " << name << " passed";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kIo);
  }
  ShmSegment::unlink(name);
}

TEST(ShmSegment, AttachRefusesOtherModesSizesAndMissingNames) {
  std::string name = ShmSegment::random_name();
  ShmSegment created = ShmSegment::create(name, 4096);
  EXPECT_THROW(ShmSegment::attach(name, 8192), Error);
  ASSERT_EQ(::chmod(("/dev/shm" + name).c_str(), 0644), 0);
  try {
    ShmSegment::attach(name, 4096);
    ADD_FAILURE() << "attached to a segment of mode 0644";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mode 0600"), std::string::npos) << e.what();
  }
  ShmSegment::unlink(name);
  EXPECT_THROW(ShmSegment::attach(name, 4096), Error);
  ShmSegment::unlink(name);  // gone already: nothing happens
}

TEST(ShmHostKey, DpHostIdOverridesTheBootIdAndHostNameOnly) {
  auto none = [](const char*) -> const char* { return nullptr; };
  auto pretend = [](const char* name) -> const char* {
    return std::strcmp(name, "DP_HOST_ID") == 0 ? "pretend-host" : nullptr;
  };
  std::string real = host_key(none);
  EXPECT_NE(real.find("boot:"), std::string::npos) << real;
  EXPECT_EQ(real, host_key(none));
  std::string pretended = host_key(pretend);
  EXPECT_EQ(pretended.rfind("id:pretend-host/", 0), 0u) << pretended;
  EXPECT_EQ(pretended.find("boot:"), std::string::npos) << pretended;
  // What the process shares with others on this machine stays in the key.
  EXPECT_EQ(pretended.substr(pretended.find("/shm:")), real.substr(real.find("/shm:")));
  EXPECT_NE(real.find("pid:["), std::string::npos) << real;
}

}  // namespace
}  // namespace dparallel::dist
