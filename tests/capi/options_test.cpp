// dp_process_group_options_init, dp_ddp_options_init and
// dp_fsdp_options_init write exactly the
// caller's struct_size bytes: a host built against an older header (a
// shorter struct) or a newer one (a longer struct) gets only its own bytes
// written.
#include <cstring>
#include <string>
#include <vector>

#include "test_util.h"

using namespace dptest;

namespace {

constexpr unsigned char kCanary = 0xA5;
constexpr size_t kCanaryBytes = 64;

void expect_same(const dp_process_group_options& a, const dp_process_group_options& b) {
  EXPECT_EQ(a.struct_size, b.struct_size);
  EXPECT_EQ(a.backend, b.backend);
  EXPECT_EQ(a.rank, b.rank);
  EXPECT_EQ(a.world_size, b.world_size);
  EXPECT_EQ(a.store, b.store);
  EXPECT_EQ(a.timeout_ms, b.timeout_ms);
  EXPECT_EQ(a.device.type, b.device.type);
  EXPECT_EQ(a.device.index, b.device.index);
}

void expect_same(const dp_ddp_options& a, const dp_ddp_options& b) {
  EXPECT_EQ(a.struct_size, b.struct_size);
  EXPECT_EQ(a.bucket_cap_mb, b.bucket_cap_mb);
  EXPECT_EQ(a.first_bucket_cap_mb, b.first_bucket_cap_mb);
  EXPECT_EQ(a.gradient_as_bucket_view, b.gradient_as_bucket_view);
  EXPECT_EQ(a.broadcast_buffers, b.broadcast_buffers);
  EXPECT_EQ(a.find_unused_parameters, b.find_unused_parameters);
  EXPECT_EQ(a.init_sync, b.init_sync);
  EXPECT_EQ(a.ignored_modules, b.ignored_modules);
  EXPECT_EQ(a.num_ignored_modules, b.num_ignored_modules);
  EXPECT_EQ(a.ignored_parameters, b.ignored_parameters);
  EXPECT_EQ(a.num_ignored_parameters, b.num_ignored_parameters);
  EXPECT_EQ(a.comm_hook, b.comm_hook);
  EXPECT_EQ(a.hook_fn, b.hook_fn);
  EXPECT_EQ(a.hook_user_data, b.hook_user_data);
}

void expect_same(const dp_fsdp_options& a, const dp_fsdp_options& b) {
  EXPECT_EQ(a.struct_size, b.struct_size);
  EXPECT_EQ(a.reshard_after_forward, b.reshard_after_forward);
  EXPECT_EQ(a.param_dtype, b.param_dtype);
  EXPECT_EQ(a.reduce_dtype, b.reduce_dtype);
  EXPECT_EQ(a.init_sync, b.init_sync);
  EXPECT_EQ(a.full_params_as_views, b.full_params_as_views);
}

template <typename Options>
struct InitFn;
template <>
struct InitFn<dp_process_group_options> {
  static dp_status call(dp_process_group_options* o, size_t n) { return dp_process_group_options_init(o, n); }
  static dp_process_group_options macro() { return DP_PROCESS_GROUP_OPTIONS_INIT; }
};
template <>
struct InitFn<dp_ddp_options> {
  static dp_status call(dp_ddp_options* o, size_t n) { return dp_ddp_options_init(o, n); }
  static dp_ddp_options macro() { return DP_DDP_OPTIONS_INIT; }
};

template <>
struct InitFn<dp_fsdp_options> {
  static dp_status call(dp_fsdp_options* o, size_t n) { return dp_fsdp_options_init(o, n); }
  static dp_fsdp_options macro() { return DP_FSDP_OPTIONS_INIT; }
};

// One allocation: `struct_size` bytes for the options, then a canary.
template <typename Options>
std::vector<unsigned char> init_into_buffer(size_t struct_size, dp_status* status) {
  // Backed by Options values so that the start is aligned for them.
  const size_t total = struct_size + kCanaryBytes;
  std::vector<Options> storage(total / sizeof(Options) + 1);
  auto* bytes = reinterpret_cast<unsigned char*>(storage.data());
  std::memset(bytes, kCanary, total);
  *status = InitFn<Options>::call(reinterpret_cast<Options*>(bytes), struct_size);
  return std::vector<unsigned char>(bytes, bytes + total);
}

template <typename Options>
class OptionsInit : public ::testing::Test {};
using OptionTypes = ::testing::Types<dp_process_group_options, dp_ddp_options, dp_fsdp_options>;
TYPED_TEST_SUITE(OptionsInit, OptionTypes);

TYPED_TEST(OptionsInit, FullSizeGivesTheMacrosValues) {
  TypeParam o;
  std::memset(&o, kCanary, sizeof(o));
  DP_ASSERT_OK(InitFn<TypeParam>::call(&o, sizeof(o)));
  expect_same(o, InitFn<TypeParam>::macro());
}

TYPED_TEST(OptionsInit, ShorterStructFromAnOlderHeaderKeepsTheBytesAfterIt) {
  TypeParam full;
  DP_ASSERT_OK(InitFn<TypeParam>::call(&full, sizeof(full)));
  const auto* full_bytes = reinterpret_cast<const unsigned char*>(&full);
  for (size_t n = sizeof(size_t); n < sizeof(TypeParam); ++n) {
    SCOPED_TRACE("struct_size " + std::to_string(n));
    dp_status status = DP_EINTERNAL;
    std::vector<unsigned char> buf = init_into_buffer<TypeParam>(n, &status);
    ASSERT_EQ(status, DP_OK) << dp_last_error();
    size_t written_size = 0;
    std::memcpy(&written_size, buf.data(), sizeof(size_t));
    EXPECT_EQ(written_size, n) << "struct_size must say how much the caller has";
    EXPECT_EQ(std::memcmp(buf.data() + sizeof(size_t), full_bytes + sizeof(size_t), n - sizeof(size_t)), 0);
    for (size_t i = n; i < buf.size(); ++i) {
      ASSERT_EQ(buf[i], kCanary) << "byte " << i << " past a struct of " << n << " bytes was written";
    }
  }
}

TYPED_TEST(OptionsInit, LongerStructFromANewerHeaderGetsZerosPastOurFields) {
  TypeParam full;
  DP_ASSERT_OK(InitFn<TypeParam>::call(&full, sizeof(full)));
  const auto* full_bytes = reinterpret_cast<const unsigned char*>(&full);
  const size_t n = sizeof(TypeParam) + 24;
  dp_status status = DP_EINTERNAL;
  std::vector<unsigned char> buf = init_into_buffer<TypeParam>(n, &status);
  ASSERT_EQ(status, DP_OK) << dp_last_error();
  size_t written_size = 0;
  std::memcpy(&written_size, buf.data(), sizeof(size_t));
  EXPECT_EQ(written_size, n);
  EXPECT_EQ(std::memcmp(buf.data() + sizeof(size_t), full_bytes + sizeof(size_t), sizeof(TypeParam) - sizeof(size_t)),
            0);
  for (size_t i = sizeof(TypeParam); i < n; ++i) EXPECT_EQ(buf[i], 0) << "byte " << i;
  for (size_t i = n; i < buf.size(); ++i) EXPECT_EQ(buf[i], kCanary) << "byte " << i;
}

TYPED_TEST(OptionsInit, StructSizeBelowASizeTOrNullOptsIsEinvalNamingTheArgument) {
  for (size_t n : {size_t{0}, size_t{1}, sizeof(size_t) - 1}) {
    dp_status status = DP_OK;
    std::vector<unsigned char> buf = init_into_buffer<TypeParam>(n, &status);
    EXPECT_EQ(status, DP_EINVAL) << "struct_size " << n;
    EXPECT_NE(last_error().find("'struct_size'"), std::string::npos) << last_error();
    for (size_t i = 0; i < buf.size(); ++i) ASSERT_EQ(buf[i], kCanary) << "byte " << i;
  }
  EXPECT_EQ(InitFn<TypeParam>::call(nullptr, sizeof(TypeParam)), DP_EINVAL);
  EXPECT_NE(last_error().find("'opts'"), std::string::npos) << last_error();
}

TEST(OptionsInitTable, TheTableSlotsTakeTheStructSize) {
  const dp_api* api = dp_get_api(DP_VERSION_MAJOR);
  ASSERT_NE(api, nullptr);
  ASSERT_GE(api->abi_minor, 3u);
  dp_process_group_options pg;
  DP_ASSERT_OK(api->process_group_options_init(&pg, sizeof(pg)));
  expect_same(pg, InitFn<dp_process_group_options>::macro());
  dp_ddp_options ddp;
  DP_ASSERT_OK(api->ddp_options_init(&ddp, sizeof(ddp)));
  expect_same(ddp, InitFn<dp_ddp_options>::macro());
  ASSERT_GE(api->abi_minor, 7u);
  dp_fsdp_options fsdp;
  DP_ASSERT_OK(api->fsdp_options_init(&fsdp, sizeof(fsdp)));
  expect_same(fsdp, InitFn<dp_fsdp_options>::macro());
}

}  // namespace
