// dp_process_group_options_init, dp_ddp_options_init and
// dp_fsdp_options_init write exactly the
// caller's struct_size bytes: a host built against an older header (a
// shorter struct) or a newer one (a longer struct) gets only its own bytes
// written. A struct_size that ends inside a field is no header's and is
// refused wherever the library reads or writes such a struct.
#include <unistd.h>

#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "module/module_test_util.h"
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

// Where each field of the structs lies, as this test reads the headers.
struct Span {
  const char* name;
  size_t begin;
  size_t end;
};
#define SPAN(type, field) \
  Span { #field, offsetof(type, field), offsetof(type, field) + sizeof(type::field) }

template <typename Struct>
struct Layout;
template <>
struct Layout<dp_process_group_options> {
  static constexpr const char* kName = "dp_process_group_options";
  static std::vector<Span> fields() {
    using T = dp_process_group_options;
    return {SPAN(T, struct_size), SPAN(T, backend),    SPAN(T, rank),  SPAN(T, world_size),
            SPAN(T, store),       SPAN(T, timeout_ms), SPAN(T, device)};
  }
};
template <>
struct Layout<dp_ddp_options> {
  static constexpr const char* kName = "dp_ddp_options";
  static std::vector<Span> fields() {
    using T = dp_ddp_options;
    return {SPAN(T, struct_size),
            SPAN(T, bucket_cap_mb),
            SPAN(T, first_bucket_cap_mb),
            SPAN(T, gradient_as_bucket_view),
            SPAN(T, broadcast_buffers),
            SPAN(T, find_unused_parameters),
            SPAN(T, init_sync),
            SPAN(T, ignored_modules),
            SPAN(T, num_ignored_modules),
            SPAN(T, ignored_parameters),
            SPAN(T, num_ignored_parameters),
            SPAN(T, comm_hook),
            SPAN(T, hook_fn),
            SPAN(T, hook_user_data),
            SPAN(T, static_graph),
            SPAN(T, join_divide_by_initial_world_size),
            SPAN(T, on_bucket_reduced),
            SPAN(T, on_bucket_reduced_data),
            SPAN(T, bucket_plan)};
  }
};
template <>
struct Layout<dp_fsdp_options> {
  static constexpr const char* kName = "dp_fsdp_options";
  static std::vector<Span> fields() {
    using T = dp_fsdp_options;
    return {SPAN(T, struct_size), SPAN(T, reshard_after_forward), SPAN(T, param_dtype), SPAN(T, reduce_dtype),
            SPAN(T, init_sync),   SPAN(T, full_params_as_views)};
  }
};
template <>
struct Layout<dp_ddp_stats> {
  static constexpr const char* kName = "dp_ddp_stats";
  static std::vector<Span> fields() {
    using T = dp_ddp_stats;
    return {SPAN(T, struct_size), SPAN(T, backward_ms), SPAN(T, reduce_ms),
            SPAN(T, exposed_ms),  SPAN(T, num_buckets), SPAN(T, buckets_rebuilt)};
  }
};
template <>
struct Layout<dp_memory_stats> {
  static constexpr const char* kName = "dp_memory_stats";
  static std::vector<Span> fields() {
    using T = dp_memory_stats;
    return {SPAN(T, struct_size), SPAN(T, allocated_bytes), SPAN(T, peak_allocated_bytes), SPAN(T, cached_bytes)};
  }
};
#undef SPAN

// The field a struct_size of `n` ends inside, or nullptr where it ends on a
// boundary (a field's end, its padding, or past every field).
template <typename Struct>
const char* field_cut_by(size_t n) {
  static const std::vector<Span> fields = Layout<Struct>::fields();
  for (const Span& f : fields) {
    if (n > f.begin && n < f.end) return f.name;
  }
  return nullptr;
}

// Expects the last error to refuse struct_size `n` as ending inside its field.
template <typename Struct>
void expect_cut_refused(size_t n) {
  const std::string error = last_error();
  EXPECT_NE(error.find("struct_size"), std::string::npos) << error;
  const std::string cut =
      std::to_string(n) + ", which ends inside field '" + field_cut_by<Struct>(n) + "' of " + Layout<Struct>::kName;
  EXPECT_NE(error.find(cut), std::string::npos) << error;
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
    if (field_cut_by<TypeParam>(n) != nullptr) continue;  // no header's size
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

TYPED_TEST(OptionsInit, StructSizeEndingInsideAFieldIsEinvalNamingItAndWritesNothing) {
  size_t refused = 0;
  for (size_t n = sizeof(size_t); n < sizeof(TypeParam); ++n) {
    if (field_cut_by<TypeParam>(n) == nullptr) continue;
    SCOPED_TRACE("struct_size " + std::to_string(n));
    dp_status status = DP_OK;
    std::vector<unsigned char> buf = init_into_buffer<TypeParam>(n, &status);
    EXPECT_EQ(status, DP_EINVAL);
    EXPECT_NE(last_error().find("'struct_size'"), std::string::npos) << last_error();
    expect_cut_refused<TypeParam>(n);
    for (size_t i = 0; i < buf.size(); ++i) ASSERT_EQ(buf[i], kCanary) << "byte " << i;
    ++refused;
  }
  EXPECT_GT(refused, 0u);
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

// The caller's struct as a host with a header of `struct_size` bytes has
// it: `value`'s bytes up to there, then bytes it never meant for us (`tail`).
template <typename Struct>
class HostStruct {
 public:
  HostStruct(const Struct& value, size_t struct_size, unsigned char tail)
      : storage_((sizeof(Struct) + 64) / sizeof(Struct) + 1) {
    std::memset(bytes(), tail, size());
    std::memcpy(bytes(), &value, std::min(struct_size, sizeof(Struct)));
    std::memcpy(bytes(), &struct_size, sizeof(size_t));
  }
  Struct* get() { return storage_.data(); }
  unsigned char* bytes() { return reinterpret_cast<unsigned char*>(storage_.data()); }
  size_t size() const { return storage_.size() * sizeof(Struct); }

 private:
  std::vector<Struct> storage_;
};

// A world-1 group over a file store, and a module of one parameter.
class StructSizeRead : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = temp_path("struct_size_", "store");
    ::unlink(path_.c_str());
    DP_ASSERT_OK(dp_store_create_file(&store_, path_.c_str(), 1));
  }
  void TearDown() override {
    dp_process_group_destroy(pg_);
    dp_store_destroy(store_);
    ::unlink(path_.c_str());
  }
  dp_process_group_options group_options() {
    dp_process_group_options o = DP_PROCESS_GROUP_OPTIONS_INIT;
    o.rank = 0;
    o.world_size = 1;
    o.store = store_;
    o.timeout_ms = 60000;
    return o;
  }
  void make_group() {
    dp_process_group_options o = group_options();
    DP_ASSERT_OK(dp_process_group_create(&pg_, &o));
  }
  ModulePtr module() {
    ModulePtr m = new_module();
    TensorPtr w = make<float>({8}, std::vector<float>(8, 1.0f));
    EXPECT_EQ(dp_module_register_parameter(m.get(), "w", w.get(), 1), DP_OK) << dp_last_error();
    return m;
  }

  std::string path_;
  dp_store* store_ = nullptr;
  dp_process_group* pg_ = nullptr;
};

TEST_F(StructSizeRead, ProcessGroupCreateRefusesASizeEndingInsideAFieldAndTakesOlderAndNewerOnes) {
  const size_t cut = offsetof(dp_process_group_options, store) + 4;  // half the store pointer
  HostStruct<dp_process_group_options> mid(group_options(), cut, 0xA5);
  dp_process_group* pg = nullptr;
  EXPECT_EQ(dp_process_group_create(&pg, mid.get()), DP_EINVAL);
  EXPECT_EQ(pg, nullptr);
  expect_cut_refused<dp_process_group_options>(cut);
  EXPECT_NE(last_error().find("argument 'opts'"), std::string::npos) << last_error();

  // Older: no device field (the default, cpu:0); what follows is not read.
  HostStruct<dp_process_group_options> older(group_options(), offsetof(dp_process_group_options, device), 0xA5);
  ASSERT_EQ(dp_process_group_create(&pg, older.get()), DP_OK) << dp_last_error();
  EXPECT_EQ(dp_process_group_size(pg), 1);
  dp_process_group_destroy(pg);
  pg = nullptr;
  ::unlink(path_.c_str());
  dp_store_destroy(store_);
  DP_ASSERT_OK(dp_store_create_file(&store_, path_.c_str(), 1));

  // Newer: fields past ours, zero as its init leaves them, are ignored.
  HostStruct<dp_process_group_options> newer(group_options(), sizeof(dp_process_group_options) + 16, 0);
  ASSERT_EQ(dp_process_group_create(&pg, newer.get()), DP_OK) << dp_last_error();
  dp_process_group_destroy(pg);
}

TEST_F(StructSizeRead, DdpCreateRefusesASizeEndingInsideAPointerAndTakesOlderAndNewerOnes) {
  make_group();
  static const char kPlan[] = "not a plan";
  dp_ddp_options o = DP_DDP_OPTIONS_INIT;
  o.bucket_plan = kPlan;  // half of this pointer would be read as one
  for (size_t cut : {offsetof(dp_ddp_options, bucket_plan) + 4, offsetof(dp_ddp_options, hook_fn) + 1,
                     offsetof(dp_ddp_options, bucket_cap_mb) + 4}) {
    SCOPED_TRACE("struct_size " + std::to_string(cut));
    HostStruct<dp_ddp_options> mid(o, cut, 0xA5);
    ModulePtr m = module();
    dp_ddp* ddp = nullptr;
    EXPECT_EQ(dp_ddp_create(&ddp, m.get(), pg_, mid.get()), DP_EINVAL);
    EXPECT_EQ(ddp, nullptr);
    expect_cut_refused<dp_ddp_options>(cut);
  }
  dp_ddp_options plain = DP_DDP_OPTIONS_INIT;
  for (size_t n : {offsetof(dp_ddp_options, static_graph), sizeof(dp_ddp_options) + 16}) {
    SCOPED_TRACE("struct_size " + std::to_string(n));
    HostStruct<dp_ddp_options> accepted(plain, n, n > sizeof(dp_ddp_options) ? 0 : 0xA5);
    ModulePtr m = module();
    dp_ddp* ddp = nullptr;
    ASSERT_EQ(dp_ddp_create(&ddp, m.get(), pg_, accepted.get()), DP_OK) << dp_last_error();
    dp_ddp_destroy(ddp);
  }
}

TEST_F(StructSizeRead, FsdpCreateRefusesASizeEndingInsideAFieldAndTakesOlderAndNewerOnes) {
  make_group();
  const dp_fsdp_options o = DP_FSDP_OPTIONS_INIT;
  const size_t cut = offsetof(dp_fsdp_options, init_sync) + 2;
  HostStruct<dp_fsdp_options> mid(o, cut, 0xA5);
  ModulePtr refused = module();
  dp_fsdp* fsdp = nullptr;
  EXPECT_EQ(dp_fsdp_create(&fsdp, refused.get(), pg_, mid.get()), DP_EINVAL);
  EXPECT_EQ(fsdp, nullptr);
  expect_cut_refused<dp_fsdp_options>(cut);
  for (size_t n : {offsetof(dp_fsdp_options, full_params_as_views), sizeof(dp_fsdp_options) + 16}) {
    SCOPED_TRACE("struct_size " + std::to_string(n));
    HostStruct<dp_fsdp_options> accepted(o, n, n > sizeof(dp_fsdp_options) ? 0 : 0xA5);
    ModulePtr m = module();
    ASSERT_EQ(dp_fsdp_create(&fsdp, m.get(), pg_, accepted.get()), DP_OK) << dp_last_error();
    dp_fsdp_destroy(fsdp);
    fsdp = nullptr;
  }
}

// A stats struct of `n` bytes as the host passes it: struct_size stays n,
// the library writes no byte past min(n, what it knows); the rest keeps the
// canary.
template <typename Stats>
void expect_written_up_to(HostStruct<Stats>& out, size_t n) {
  size_t written_size = 0;
  std::memcpy(&written_size, out.bytes(), sizeof(size_t));
  EXPECT_EQ(written_size, n);
  for (size_t i = std::min(n, sizeof(Stats)); i < out.size(); ++i) {
    ASSERT_EQ(out.bytes()[i], kCanary) << "byte " << i;
  }
}

TEST_F(StructSizeRead, StatsRefuseASizeEndingInsideAFieldAndFillOlderAndNewerOnesUpToTheirSize) {
  make_group();
  ModulePtr m = module();
  dp_ddp* ddp = nullptr;
  DP_ASSERT_OK(dp_ddp_create(&ddp, m.get(), pg_, nullptr));
  dp_ddp_stats ddp_stats;  // the host's struct before the call: all canary
  std::memset(&ddp_stats, kCanary, sizeof ddp_stats);
  dp_memory_stats memory_stats;
  std::memset(&memory_stats, kCanary, sizeof memory_stats);

  const size_t ddp_cut = offsetof(dp_ddp_stats, num_buckets) + 4;
  HostStruct<dp_ddp_stats> ddp_mid(ddp_stats, ddp_cut, kCanary);
  EXPECT_EQ(dp_ddp_last_stats(ddp, ddp_mid.get()), DP_EINVAL);
  expect_cut_refused<dp_ddp_stats>(ddp_cut);
  EXPECT_NE(last_error().find("argument 'out'"), std::string::npos) << last_error();
  for (size_t i = sizeof(size_t); i < ddp_mid.size(); ++i) ASSERT_EQ(ddp_mid.bytes()[i], kCanary) << "byte " << i;

  const size_t memory_cut = offsetof(dp_memory_stats, cached_bytes) + 4;
  HostStruct<dp_memory_stats> memory_mid(memory_stats, memory_cut, kCanary);
  EXPECT_EQ(dp_device_memory_stats(cpu(0), memory_mid.get()), DP_EINVAL);
  expect_cut_refused<dp_memory_stats>(memory_cut);
  for (size_t i = sizeof(size_t); i < memory_mid.size(); ++i) {
    ASSERT_EQ(memory_mid.bytes()[i], kCanary) << "byte " << i;
  }

  // Older (ending after a field, or in the padding after the last) and
  // newer sizes: written as far as each goes, never past it.
  for (size_t n : {offsetof(dp_ddp_stats, num_buckets), offsetof(dp_ddp_stats, buckets_rebuilt) + sizeof(int) + 2,
                   sizeof(dp_ddp_stats) + 16}) {
    SCOPED_TRACE("dp_ddp_stats of " + std::to_string(n) + " bytes");
    HostStruct<dp_ddp_stats> out(ddp_stats, n, kCanary);
    ASSERT_EQ(dp_ddp_last_stats(ddp, out.get()), DP_OK) << dp_last_error();
    expect_written_up_to(out, n);
  }
  for (size_t n : {offsetof(dp_memory_stats, cached_bytes), sizeof(dp_memory_stats) + 16}) {
    SCOPED_TRACE("dp_memory_stats of " + std::to_string(n) + " bytes");
    HostStruct<dp_memory_stats> out(memory_stats, n, kCanary);
    ASSERT_EQ(dp_device_memory_stats(cpu(0), out.get()), DP_OK) << dp_last_error();
    expect_written_up_to(out, n);
  }
  dp_ddp_destroy(ddp);
}

}  // namespace
