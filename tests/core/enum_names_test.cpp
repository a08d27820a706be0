// Every enumerator of the enums that messages name has a name of its own:
// each is listed once (the X-macro lists beside the enums), and a name
// copied without its edit would make two read alike.
#include <gtest/gtest.h>

#include <iterator>
#include <set>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "ddp/comm_hooks.h"
#include "distributed/call_header.h"
#include "distributed/collective.h"

using namespace dparallel;

namespace {

// Each name non-empty, not the fallback for an unknown value, and distinct.
void expect_distinct_names(const std::vector<std::string>& names, const char* unknown) {
  std::set<std::string> seen;
  for (const std::string& name : names) {
    EXPECT_FALSE(name.empty());
    EXPECT_NE(name, unknown);
    EXPECT_TRUE(seen.insert(name).second) << "the name '" << name << "' is given twice";
  }
}

}  // namespace

TEST(DtypeNames, EveryDtypeHasADistinctNonEmptyNameAndASize) {
  const std::vector<DType> all = {
#define DP_DTYPE_VALUE(id, code, name, size, c_name) DType::id,
      DP_DTYPES(DP_DTYPE_VALUE)
#undef DP_DTYPE_VALUE
  };
  ASSERT_EQ(all.size(), static_cast<size_t>(kNumDTypes));
  std::vector<std::string> names;
  for (DType d : all) {
    names.emplace_back(dtype_name(d));
    EXPECT_GT(dtype_size(d), 0u) << dtype_name(d);
  }
  expect_distinct_names(names, "unknown");
  EXPECT_STREQ(dtype_name(static_cast<DType>(kNumDTypes)), "unknown");
  EXPECT_EQ(dtype_size(static_cast<DType>(-1)), 0u);
}

TEST(ReduceOpNames, EveryReduceOpHasADistinctNonEmptyNameAndCName) {
  const std::vector<dist::ReduceOp> all = {
#define DP_REDUCE_OP_VALUE(id, code, name, c_name) dist::ReduceOp::id,
      DP_REDUCE_OPS(DP_REDUCE_OP_VALUE)
#undef DP_REDUCE_OP_VALUE
  };
  std::vector<std::string> names, c_names;
  for (dist::ReduceOp op : all) {
    names.emplace_back(dist::reduce_op_name(op));
    c_names.emplace_back(dist::kReduceOps[static_cast<size_t>(op)].c_name);
  }
  expect_distinct_names(names, "unknown");
  expect_distinct_names(c_names, "unknown");
  EXPECT_STREQ(dist::reduce_op_name(static_cast<dist::ReduceOp>(all.size())), "unknown");
}

TEST(ReduceOpNames, AnUnknownCodeIsRefusedListingEveryCName) {
  try {
    dist::reduce_op_arg(static_cast<int32_t>(std::size(dist::kReduceOps)), "op");
    FAIL() << "an unknown reduce op was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("DP_SUM, DP_AVG, DP_MIN, DP_MAX or DP_PROD (0..4)"), std::string::npos)
        << e.what();
  }
}

TEST(CallKindNames, EveryCallKindHasADistinctNonEmptyName) {
  const std::vector<dist::CallKind> all = {
#define DP_CALL_KIND_VALUE(id, value, name) dist::CallKind::id,
      DP_CALL_KINDS(DP_CALL_KIND_VALUE)
#undef DP_CALL_KIND_VALUE
  };
  std::vector<std::string> names;
  names.reserve(all.size());
  for (dist::CallKind kind : all) names.emplace_back(dist::call_kind_name(static_cast<uint32_t>(kind)));
  expect_distinct_names(names, "unknown collective");
}

TEST(CommHookNames, EveryCommHookHasADistinctNonEmptyNameAndCName) {
  const std::vector<ddp::HookKind> all = {
#define DP_COMM_HOOK_VALUE(id, code, name, c_name) ddp::HookKind::id,
      DP_COMM_HOOKS(DP_COMM_HOOK_VALUE)
#undef DP_COMM_HOOK_VALUE
  };
  std::vector<std::string> names, c_names;
  for (ddp::HookKind hook : all) {
    names.emplace_back(ddp::hook_name(hook));
    c_names.emplace_back(ddp::kHookKinds[static_cast<size_t>(hook)].c_name);
  }
  expect_distinct_names(names, "unknown");
  expect_distinct_names(c_names, "unknown");
  EXPECT_STREQ(ddp::hook_name(static_cast<ddp::HookKind>(all.size())), "unknown");
}
