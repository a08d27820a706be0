// The NCCL group's header checks and messages, which need neither NCCL nor a GPU.
#include "distributed/nccl/nccl_header.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace dparallel::dist::nccl {
namespace {

Header header(Kind kind, DType dtype, int64_t numel, uint64_t seq, ReduceOp op = ReduceOp::kSum, int32_t root = -1) {
  return make_header(kind, dtype, numel, seq, op, root);
}

// The error rank `rank` raises for the gathered headers `all`, or kOk.
StatusCode status_on(const std::vector<Header>& all, int32_t rank, std::string* message = nullptr) {
  try {
    check_headers(all[static_cast<size_t>(rank)], all.data(), rank, static_cast<int32_t>(all.size()));
  } catch (const Error& e) {
    if (message != nullptr) *message = e.what();
    return e.code();
  }
  return StatusCode::kOk;
}

TEST(NcclHeader, MatchingHeadersPassOnEveryRank) {
  std::vector<Header> all(3, header(Kind::kAllReduce, DType::kFloat32, 1000, 7, ReduceOp::kAvg));
  for (int32_t r = 0; r < 3; ++r) EXPECT_EQ(status_on(all, r), StatusCode::kOk) << "rank " << r;
}

TEST(NcclHeader, DifferentSizesAreInvalidAndNameBothRanksAndSizes) {
  std::vector<Header> all = {header(Kind::kAllReduce, DType::kFloat32, 10, 1),
                             header(Kind::kAllReduce, DType::kFloat32, 11, 1)};
  std::string message;
  EXPECT_EQ(status_on(all, 0, &message), StatusCode::kInvalidArgument);
  EXPECT_NE(message.find("all_reduce: arguments differ across ranks"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 0 has 10 elements of float32"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 1 has 11 elements of float32"), std::string::npos) << message;
  EXPECT_EQ(status_on(all, 1, &message), StatusCode::kInvalidArgument);
  EXPECT_NE(message.find("rank 1 has 11 elements"), std::string::npos) << message;
}

TEST(NcclHeader, DifferentDtypeOpOrRootIsInvalid) {
  const Header base = header(Kind::kBroadcast, DType::kInt32, 4, 2, ReduceOp::kSum, 0);
  Header dtype = base, op = base, root = base;
  dtype.dtype = static_cast<int32_t>(DType::kInt64);
  op.op = static_cast<int32_t>(ReduceOp::kMax);
  root.root = 1;
  for (const Header& other : {dtype, op, root}) {
    std::vector<Header> all = {base, other};
    std::string message;
    EXPECT_EQ(status_on(all, 0, &message), StatusCode::kInvalidArgument) << message;
    EXPECT_NE(message.find("broadcast"), std::string::npos) << message;
  }
}

TEST(NcclHeader, OutOfStepRankIsRemoteAndNamesBothCollectives) {
  std::vector<Header> all = {header(Kind::kAllReduce, DType::kFloat32, 10, 4),
                             header(Kind::kBarrier, DType::kUInt8, 0, 4)};
  std::string message;
  EXPECT_EQ(status_on(all, 0, &message), StatusCode::kRemote);
  EXPECT_NE(message.find("rank 1 called barrier as its collective #4"), std::string::npos) << message;
  EXPECT_EQ(status_on(all, 1, &message), StatusCode::kRemote);
  EXPECT_NE(message.find("rank 0 called all_reduce"), std::string::npos) << message;
}

// Rank 1's size differs and rank 2 is a collective behind: every rank must see
// the group as out of step (kRemote breaks it everywhere), none as a mere
// argument mismatch that would leave it alone waiting on the others.
TEST(NcclHeader, EveryRankClassifiesMixedMismatchesAlike) {
  std::vector<Header> all = {header(Kind::kAllReduce, DType::kFloat32, 10, 5),
                             header(Kind::kAllReduce, DType::kFloat32, 12, 5),
                             header(Kind::kAllReduce, DType::kFloat32, 10, 4)};
  for (int32_t r = 0; r < 3; ++r) EXPECT_EQ(status_on(all, r), StatusCode::kRemote) << "rank " << r;
}

TEST(NcclHeader, UnknownKindsAndValuesAreNamedWithoutCrashing) {
  EXPECT_STREQ(kind_name(static_cast<uint32_t>(Kind::kReduceScatter)), "reduce_scatter");
  EXPECT_STREQ(kind_name(0), "?");
  EXPECT_STREQ(kind_name(99), "?");
  Header garbage = header(Kind::kAllGather, DType::kFloat32, 3, 1);
  garbage.dtype = 77;
  garbage.op = -5;
  std::vector<Header> all = {header(Kind::kAllGather, DType::kFloat32, 3, 1), garbage};
  EXPECT_EQ(status_on(all, 0), StatusCode::kInvalidArgument);
}

TEST(NcclHeader, FailureMessageNamesTheCollectiveTensorRankAndMissingRanks) {
  std::string m = failure_message("all_reduce", "float32 8388608 on cuda:0", 0, 2, "timed out after 3000 ms",
                                  "rank(s) 1 did not arrive");
  EXPECT_EQ(m,
            "all_reduce of float32 8388608 on cuda:0 on rank 0 of 2 timed out after 3000 ms; the communicator was "
            "aborted: rank(s) 1 did not arrive");
  EXPECT_EQ(failure_message("barrier", "", 1, 3, "failed: x", "y"),
            "barrier on rank 1 of 3 failed: x; the communicator was aborted: y");
}

}  // namespace
}  // namespace dparallel::dist::nccl
