// fully_shard's layout without a process group: how rows split over the
// ranks, where each parameter lies in the segments and the region, which
// placement the shards ask for, and which rows each rank's shard holds.
#include "fsdp/sharded_param.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace {

using dparallel::Device;
using dparallel::DType;
using dparallel::Parameter;
using dparallel::Shape;
using dparallel::Storage;
using dparallel::Tensor;
using dparallel::fsdp::FullKind;
using dparallel::fsdp::RowSplit;
using dparallel::fsdp::ShardedParam;
using dparallel::fsdp::ShardLayout;
using dparallel::fsdp::ShardPlacement;
using dparallel::fsdp::split_rows;

const Device kCpu{};

// A float32 tensor holding 0, 1, 2, ... in order.
Tensor counting(const Shape& shape) {
  Tensor t = Tensor::empty(DType::kFloat32, shape, kCpu);
  auto* data = static_cast<float*>(t.data());
  for (int64_t i = 0; i < t.numel(); ++i) data[i] = static_cast<float>(i);
  return t;
}

std::vector<float> values(const Tensor& t) {
  const auto* data = static_cast<const float*>(t.data());
  return std::vector<float>(data, data + t.numel());
}

// A parameter as collect() makes one: compute and reduce dtypes given.
ShardedParam param(const std::string& name, const Tensor& value, DType compute, bool reduced = true) {
  ShardedParam m;
  m.name = name;
  m.parameter = std::make_shared<Parameter>(value, reduced);
  m.dtype = value.dtype();
  m.compute = compute;
  m.reduce = compute;
  m.full_shape = value.shape();
  m.sharded = value.ndim() > 0;
  m.reduced = reduced;
  return m;
}

}  // namespace

TEST(FsdpShardLayout, RowSplitTilesEveryRowOnceInRankOrderForWorldsOneToFive) {
  for (int64_t rows = 0; rows <= 11; ++rows) {
    for (int32_t world = 1; world <= 5; ++world) {
      const int64_t chunk = (rows + world - 1) / world;
      int64_t next = 0;
      for (int32_t rank = 0; rank < world; ++rank) {
        const RowSplit s = split_rows(rows, world, rank);
        SCOPED_TRACE(testing::Message() << rows << " rows, world " << world << ", rank " << rank);
        EXPECT_EQ(s.chunk, chunk);
        EXPECT_EQ(s.start, next);
        EXPECT_GE(s.count, 0);
        EXPECT_LE(s.count, chunk);
        next = s.start + s.count;
      }
      EXPECT_EQ(next, rows) << rows << " rows over " << world;
    }
  }
}

TEST(FsdpShardLayout, RowSplitOfAnUnevenTensorLeavesTheLastRanksShort) {
  // torch.chunk's split: 5 rows over 4 ranks are 2, 2, 1, 0.
  const std::vector<RowSplit> expected = {{2, 0, 2}, {2, 2, 2}, {2, 4, 1}, {2, 5, 0}};
  for (int32_t rank = 0; rank < 4; ++rank) {
    const RowSplit s = split_rows(5, 4, rank);
    EXPECT_EQ(s.chunk, expected[rank].chunk) << rank;
    EXPECT_EQ(s.start, expected[rank].start) << rank;
    EXPECT_EQ(s.count, expected[rank].count) << rank;
  }
  // 2 rows over 5: ranks 2..4 hold none, starting past the end.
  for (int32_t rank = 2; rank < 5; ++rank) {
    const RowSplit s = split_rows(2, 5, rank);
    EXPECT_EQ(s.start, 2) << rank;
    EXPECT_EQ(s.count, 0) << rank;
  }
}

TEST(FsdpShardLayout, SegmentsPadEachParameterToTheChunkOnACacheLineInTheKindsDtype) {
  ShardLayout layout;
  // 40 x 3 float32 over 4 ranks: chunks of 10 rows, 30 elements; bfloat16 while unsharded.
  layout.params().push_back(param("a", counting({40, 3}), DType::kBFloat16));
  layout.params().push_back(param("scalar", counting({}), DType::kFloat32));
  layout.params().push_back(param("b", counting({2}), DType::kFloat32));
  layout.params().push_back(param("frozen", counting({3}), DType::kFloat32, false));
  layout.plan(4, 1);

  EXPECT_EQ(layout.at(0).row_numel, 3);
  EXPECT_EQ(layout.at(0).padded_numel(), 30u);
  size_t segment = 0;
  // Own dtype: a takes 120 bytes, so b starts on the next cache line (128).
  std::vector<size_t> own = layout.segment_offsets(FullKind::kOwn, &segment);
  EXPECT_EQ(own, (std::vector<size_t>{0, 0, 128, 192}));
  EXPECT_EQ(segment, 256u);
  EXPECT_EQ(layout.region_bytes(ShardPlacement::kSegment), 256u);
  // Compute dtype: a takes 60 bytes in bfloat16, so b starts at 64.
  std::vector<size_t> compute = layout.segment_offsets(FullKind::kCompute, &segment);
  EXPECT_EQ(compute, (std::vector<size_t>{0, 0, 64, 128}));
  EXPECT_EQ(segment, 192u);
  // The full parameters back to back: a's 480 bytes, then b's at 512.
  size_t total = 0;
  EXPECT_EQ(layout.full_offsets(&total), (std::vector<size_t>{0, 0, 512, 576}));
  EXPECT_EQ(total, 640u);
  EXPECT_EQ(layout.region_bytes(ShardPlacement::kFullViews), 160u);  // one rank's quarter
  EXPECT_EQ(layout.region_bytes(ShardPlacement::kPrivate), 0u);

  // The reduce segments: sharded parameters that reduce, by reduce dtype,
  // each padded to its chunk; 0-d and frozen ones take no place.
  EXPECT_EQ(layout.at(0).reduce_offset, 0u);
  EXPECT_EQ(layout.at(2).reduce_offset, 0u);  // the only float32 one
  const std::map<DType, size_t> expected = {{DType::kBFloat16, 30}, {DType::kFloat32, 1}};
  EXPECT_EQ(layout.reduce_segments(), expected);
  EXPECT_TRUE(layout.reduces());
  EXPECT_EQ(layout.index_of(layout.at(2).parameter.get()), 2u);
  EXPECT_EQ(layout.index_of(nullptr), ShardLayout::npos);
}

TEST(FsdpShardLayout, ViewsAreAskedForOnlyOnSharedMemoryAndWhenNoShardIsCast) {
  ShardLayout same;
  same.params().push_back(param("w", counting({4, 2}), DType::kFloat32));
  // A 0-d parameter is copied whatever its compute dtype: no obstacle.
  same.params().push_back(param("scale", counting({}), DType::kBFloat16));
  same.plan(2, 0);
  EXPECT_EQ(same.wanted_placement(false, true), ShardPlacement::kPrivate);
  EXPECT_EQ(same.wanted_placement(true, false), ShardPlacement::kSegment);
  EXPECT_EQ(same.wanted_placement(true, true), ShardPlacement::kFullViews);

  ShardLayout cast;
  cast.params().push_back(param("w", counting({4, 2}), DType::kBFloat16));
  cast.plan(2, 0);
  EXPECT_EQ(cast.wanted_placement(true, true), ShardPlacement::kSegment);

  ShardLayout whole;
  whole.params().push_back(param("scale", counting({}), DType::kFloat32));
  whole.plan(2, 0);
  EXPECT_EQ(whole.wanted_placement(true, true), ShardPlacement::kPrivate);
}

TEST(FsdpShardLayout, PrivateShardsHoldTheRanksRowsAndTheirGradientsShareOneSegment) {
  ShardLayout layout;
  layout.params().push_back(param("a", counting({5, 3}), DType::kFloat32));
  layout.params().push_back(param("b", counting({4}), DType::kFloat32));
  layout.plan(3, 1);
  // Asked for a region but given none: private.
  layout.cut_shards(nullptr, ShardPlacement::kSegment, kCpu);
  EXPECT_EQ(layout.placement(), ShardPlacement::kPrivate);
  EXPECT_FALSE(layout.views());

  // Rank 1 of 3: a's rows [2, 4), b's rows [2, 4).
  const ShardedParam& a = layout.at(0);
  EXPECT_EQ(a.shard.shape(), (Shape{2, 3}));
  EXPECT_EQ(values(a.shard), (std::vector<float>{6, 7, 8, 9, 10, 11}));
  EXPECT_EQ(values(layout.at(1).shard), (std::vector<float>{2, 3}));

  // One float32 reduce segment: a's padded 6 elements, then b's 2.
  const Tensor segment = layout.shard_grad_segment(DType::kFloat32);
  ASSERT_TRUE(segment.defined());
  EXPECT_EQ(segment.numel(), 8);
  EXPECT_EQ(a.shard_grad.data(), segment.data());
  EXPECT_EQ(layout.at(1).shard_grad.data(), static_cast<const uint8_t*>(segment.data()) + 6 * sizeof(float));
  EXPECT_EQ(values(a.shard_grad), std::vector<float>(6, 0.0f));

  // A full value's rows go back into this rank's shard only.
  Tensor full = counting({5, 3});
  static_cast<float*>(full.data())[6] = 100.0f;
  layout.load_shard_from_full(0, full);
  EXPECT_EQ(values(a.shard), (std::vector<float>{100, 7, 8, 9, 10, 11}));
}

TEST(FsdpShardLayout, ShardGradientsOfAnotherDtypeThanTheReduceDtypeGetNoSegment) {
  ShardLayout layout;
  ShardedParam p = param("a", counting({4, 2}), DType::kFloat32);
  p.reduce = DType::kBFloat16;
  layout.params().push_back(p);
  layout.plan(2, 0);
  layout.cut_shards(nullptr, ShardPlacement::kPrivate, kCpu);
  EXPECT_FALSE(layout.shard_grad_segment(DType::kBFloat16).defined());
  EXPECT_EQ(layout.at(0).shard_grad.dtype(), DType::kFloat32);
  EXPECT_EQ(layout.at(0).shard_grad.shape(), (Shape{2, 2}));
}

TEST(FsdpShardLayout, FullViewShardsLieAtTheirRowsOfTheFullParameterInTheRegion) {
  ShardLayout layout;
  layout.params().push_back(param("a", counting({3, 2}), DType::kFloat32));
  layout.params().push_back(param("b", counting({1}), DType::kFloat32));
  layout.plan(2, 1);
  // Every rank's part back to back, as create_region_storage(all_parts) makes it.
  const size_t part = layout.region_bytes(ShardPlacement::kFullViews);
  std::shared_ptr<Storage> region = Storage::allocate(kCpu, 2 * part, true);
  layout.cut_shards(region, ShardPlacement::kFullViews, kCpu);
  ASSERT_TRUE(layout.views());

  // Rank 1 of 2 holds a's row 2: 2 rows (16 bytes) past a's start.
  const ShardedParam& a = layout.at(0);
  EXPECT_EQ(a.shard.data(), static_cast<uint8_t*>(region->data()) + 16);
  EXPECT_EQ(values(a.shard), (std::vector<float>{4, 5}));
  const Tensor full_a = layout.full_view(0);
  EXPECT_EQ(full_a.shape(), (Shape{3, 2}));
  EXPECT_EQ(values(full_a)[4], 4.0f);
  EXPECT_EQ(values(full_a)[0], 0.0f);  // rank 0's row, not written here
  // b's single row is rank 0's: this rank's empty shard stays out of the region.
  EXPECT_EQ(layout.at(1).shard.numel(), 0);
  EXPECT_NE(layout.at(1).shard.storage(), region);
}

TEST(FsdpShardLayout, SegmentRegionShardsLieAtTheOwnDtypeSegmentsOffsets) {
  ShardLayout layout;
  layout.params().push_back(param("a", counting({40, 3}), DType::kFloat32));
  layout.params().push_back(param("b", counting({4}), DType::kFloat32));
  layout.plan(4, 3);
  std::shared_ptr<Storage> region = Storage::allocate(kCpu, layout.region_bytes(ShardPlacement::kSegment), true);
  layout.cut_shards(region, ShardPlacement::kSegment, kCpu);
  EXPECT_EQ(layout.placement(), ShardPlacement::kSegment);
  EXPECT_FALSE(layout.views());
  EXPECT_EQ(layout.at(0).shard.data(), region->data());
  EXPECT_EQ(layout.at(1).shard.data(), static_cast<uint8_t*>(region->data()) + 128);
  EXPECT_EQ(values(layout.at(1).shard), (std::vector<float>{3}));
}
