// The header every rank sends before each collective (every backend alike)
// and the one verdict on it.

#include "distributed/call_header.h"

#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "core/error.h"

namespace dparallel::dist {
namespace {

// The headers of `n` ranks all calling the same collective #seq.
std::vector<CallHeader> headers(int32_t n, CallKind kind, DType dtype, int64_t numel, uint64_t seq,
                                ReduceOp op = ReduceOp::kSum, int32_t root = -1) {
  std::vector<CallHeader> all;
  for (int32_t r = 0; r < n; ++r) all.push_back(make_call_header(kind, r, seq, dtype, numel, op, root));
  return all;
}

// The error rank `rank` raises for the gathered headers `all`, or kOk.
StatusCode status_on(const std::vector<CallHeader>& all, int32_t rank, std::string* message = nullptr) {
  try {
    check_call_headers(all[static_cast<size_t>(rank)], rank, static_cast<int32_t>(all.size()),
                       [&](int32_t r) { return all[static_cast<size_t>(r)]; });
  } catch (const Error& e) {
    if (message != nullptr) *message = e.what();
    return e.code();
  }
  return StatusCode::kOk;
}

TEST(CallHeader, MatchingHeadersPassOnEveryRank) {
  auto all = headers(3, CallKind::kAllReduce, DType::kFloat32, 1000, 7, ReduceOp::kAvg);
  for (int32_t r = 0; r < 3; ++r) EXPECT_EQ(status_on(all, r), StatusCode::kOk) << "rank " << r;
}

TEST(CallHeader, DifferentSizesAreInvalidAndNameBothRanksAndSizes) {
  auto all = headers(2, CallKind::kAllReduce, DType::kFloat32, 10, 1);
  all[1].numel = 11;
  std::string message;
  EXPECT_EQ(status_on(all, 0, &message), StatusCode::kInvalidArgument);
  EXPECT_NE(message.find("all_reduce: arguments differ across ranks"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 0 has 10 elements of float32"), std::string::npos) << message;
  EXPECT_NE(message.find("rank 1 has 11 elements of float32"), std::string::npos) << message;
  EXPECT_EQ(status_on(all, 1, &message), StatusCode::kInvalidArgument);
  EXPECT_NE(message.find("rank 1 has 11 elements"), std::string::npos) << message;
}

TEST(CallHeader, DifferentDtypeOpOrRootIsInvalid) {
  const auto base = headers(2, CallKind::kBroadcast, DType::kInt32, 4, 2, ReduceOp::kSum, 0);
  auto dtype = base, op = base, root = base;
  dtype[1].dtype = static_cast<int32_t>(DType::kInt64);
  op[1].op = static_cast<int32_t>(ReduceOp::kMax);
  root[1].root = 1;
  for (const auto& all : {dtype, op, root}) {
    std::string message;
    EXPECT_EQ(status_on(all, 0, &message), StatusCode::kInvalidArgument) << message;
    EXPECT_NE(message.find("broadcast"), std::string::npos) << message;
  }
}

TEST(CallHeader, OutOfStepRankIsRemoteAndNamesBothCollectives) {
  auto all = headers(2, CallKind::kAllReduce, DType::kFloat32, 10, 4);
  all[1] = make_call_header(CallKind::kBarrier, 1, 4, DType::kUInt8, 0);
  std::string message;
  EXPECT_EQ(status_on(all, 0, &message), StatusCode::kRemote);
  EXPECT_NE(message.find("rank 1 called barrier as its collective #4"), std::string::npos) << message;
  EXPECT_EQ(status_on(all, 1, &message), StatusCode::kRemote);
  EXPECT_NE(message.find("rank 0 called all_reduce"), std::string::npos) << message;
}

// Rank 1's size differs and rank 2 is a collective behind: every rank must see
// the group as out of step (kRemote breaks it everywhere), none as a mere
// argument mismatch that would leave it alone waiting on the others.
TEST(CallHeader, EveryRankClassifiesMixedMismatchesAlike) {
  auto all = headers(3, CallKind::kAllReduce, DType::kFloat32, 10, 5);
  all[1].numel = 12;
  all[2].seq = 4;
  for (int32_t r = 0; r < 3; ++r) EXPECT_EQ(status_on(all, r), StatusCode::kRemote) << "rank " << r;
}

TEST(CallHeader, MalformedHeaderOrWrongRankIsRemote) {
  auto all = headers(2, CallKind::kAllReduce, DType::kFloat32, 10, 1);
  all[1].magic = 0;
  std::string message;
  EXPECT_EQ(status_on(all, 0, &message), StatusCode::kRemote);
  EXPECT_NE(message.find("rank 1 sent a malformed header"), std::string::npos) << message;
  all = headers(2, CallKind::kAllReduce, DType::kFloat32, 10, 1);
  all[1].rank = 0;
  EXPECT_EQ(status_on(all, 0), StatusCode::kRemote);
}

// A rank that refused its call (bad op here) still sends a header: every rank
// fails alike, with kInvalidArgument (the group stays usable), naming the
// refusing rank and its reason, whatever the others' sizes.
TEST(CallHeader, RefusalFailsEveryRankNamingTheRefusingRankAndReason) {
  for (int32_t world : {2, 3}) {
    auto all = headers(world, CallKind::kAllReduce, DType::kFloat32, 100000, 9);
    int32_t refuser = world - 1;
    all[static_cast<size_t>(refuser)] =
        refused_call_header(CallKind::kAllReduce, refuser, 9, "argument 'op' is 9; it must be DP_SUM..DP_PROD");
    for (int32_t r = 0; r < world; ++r) {
      std::string message;
      EXPECT_EQ(status_on(all, r, &message), StatusCode::kInvalidArgument) << "rank " << r << ": " << message;
      EXPECT_NE(message.find("all_reduce (collective #9): rank " + std::to_string(refuser) +
                             " refused the call: argument 'op' is 9"),
                std::string::npos)
          << message;
    }
  }
}

TEST(CallHeader, EveryRefusingRankIsNamed) {
  auto all = headers(3, CallKind::kBroadcast, DType::kInt32, 4, 2, ReduceOp::kSum, 0);
  all[0] = refused_call_header(CallKind::kBroadcast, 0, 2, "argument 'root' is 7");
  all[2] = refused_call_header(CallKind::kBroadcast, 2, 2, "argument 'tensor' is NULL");
  std::string message;
  EXPECT_EQ(status_on(all, 1, &message), StatusCode::kInvalidArgument);
  EXPECT_NE(message.find("rank 0 refused the call: argument 'root' is 7; rank 2 refused the call: argument 'tensor' "
                         "is NULL"),
            std::string::npos)
      << message;
}

// Out of step wins over a refusal, on every rank: the group is broken.
TEST(CallHeader, RefusalStandsInForAnyCollectiveAtItsPlace) {
  auto all = headers(2, CallKind::kAllReduce, DType::kFloat32, 10, 3);
  all[1] = refused_call_header(CallKind::kBroadcast, 1, 3, "argument 'root' is 5");
  for (int32_t r = 0; r < 2; ++r) {
    std::string message;
    EXPECT_EQ(status_on(all, r, &message), StatusCode::kInvalidArgument) << "rank " << r;
    EXPECT_NE(message.find("rank 1 refused the call: argument 'root' is 5"), std::string::npos) << message;
  }
}

TEST(CallHeader, RefusalAtAnotherPlaceIsOutOfStep) {
  auto all = headers(2, CallKind::kAllReduce, DType::kFloat32, 10, 3);
  all[1] = refused_call_header(CallKind::kAllReduce, 1, 4, "argument 'root' is 5");
  for (int32_t r = 0; r < 2; ++r) EXPECT_EQ(status_on(all, r), StatusCode::kRemote) << "rank " << r;
}

TEST(CallHeader, CallsOfTwoDifferentOwnersAreOutOfStepNamingBoth) {
  auto all = headers(2, CallKind::kAllReduce, DType::kFloat32, 10, 3);
  all[0].tag.owner = 1;  // dp_ddp #0
  all[0].tag.job = 7;
  all[0].tag.iteration = 2;
  all[0].tag.item = static_cast<uint32_t>(CallItem::kBucket) << 24 | 1;
  all[1].tag.owner = 2;  // dp_ddp #1
  all[1].tag.job = 7;
  all[1].tag.iteration = 2;
  all[1].tag.item = static_cast<uint32_t>(CallItem::kBucket) << 24 | 1;
  for (int32_t r = 0; r < 2; ++r) {
    std::string message;
    EXPECT_EQ(status_on(all, r, &message), StatusCode::kRemote) << "rank " << r;
    EXPECT_NE(message.find("dp_ddp #0's job #7 (bucket 1's reduction, iteration 2)"), std::string::npos) << message;
    EXPECT_NE(message.find("dp_ddp #1's job #7 (bucket 1's reduction, iteration 2)"), std::string::npos) << message;
  }
  all[1].tag = CallTag{};
  std::string message;
  EXPECT_EQ(status_on(all, 1, &message), StatusCode::kRemote);
  EXPECT_NE(message.find("the host's own call"), std::string::npos) << message;
}

TEST(CallHeader, ACallMadeUnderATagScopeCarriesItAndTheScopeRestoresTheOuterTag) {
  EXPECT_EQ(current_call_tag(), CallTag{});
  CallTag outer;
  outer.owner = kLaneRoundOwner;
  outer.job = 4;
  {
    CallTagScope scope(outer);
    EXPECT_EQ(make_call_header(CallKind::kAllGather, 0, 1, DType::kInt64, 3).tag, outer);
    EXPECT_NE(describe_call_tag(outer).find("agreement round #4"), std::string::npos);
  }
  EXPECT_EQ(make_call_header(CallKind::kAllGather, 0, 1, DType::kInt64, 3).tag, CallTag{});
}

TEST(CallHeader, LongReasonIsCutAndAnUnterminatedOneIsReadWithinItsBuffer) {
  CallHeader h = refused_call_header(CallKind::kAllGather, 0, 1, std::string(2000, 'x'));
  EXPECT_EQ(std::string(h.reason).size(), kRefusalReasonBytes - 1);
  EXPECT_EQ(std::string(h.reason).substr(kRefusalReasonBytes - 4), "...");
  auto all = headers(2, CallKind::kAllGather, DType::kFloat32, 3, 1);
  all[1].refused = 1;
  std::memset(all[1].reason, 'y', sizeof(all[1].reason));  // no NUL from a peer
  std::string message;
  EXPECT_EQ(status_on(all, 0, &message), StatusCode::kInvalidArgument);
  EXPECT_NE(message.find("rank 1 refused the call: " + std::string(kRefusalReasonBytes, 'y') + " ("), std::string::npos)
      << message;
}

TEST(CallHeader, UnknownKindsAndValuesAreNamedWithoutCrashing) {
  EXPECT_STREQ(call_kind_name(static_cast<uint32_t>(CallKind::kReduceScatter)), "reduce_scatter");
  EXPECT_STREQ(call_kind_name(0), "unknown collective");
  EXPECT_STREQ(call_kind_name(99), "unknown collective");
  auto all = headers(2, CallKind::kAllGather, DType::kFloat32, 3, 1);
  all[1].dtype = 77;
  all[1].op = -5;
  EXPECT_EQ(status_on(all, 0), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace dparallel::dist
