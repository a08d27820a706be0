// Who holds a parameter (Parameter::claim): the one mechanism by which a
// dp_ddp and a dp_fsdp refuse each other's parameters.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "core/error.h"
#include "core/tensor.h"
#include "module/module.h"

namespace dparallel {
namespace {

class Owner final : public ParameterOwner {
 public:
  const char* owner_kind() const override { return "dp_ddp"; }
};

class Sharding final : public ParameterSharding {
 public:
  const char* owner_kind() const override { return "dp_fsdp"; }
  std::string grad_refusal(const Parameter&) const override { return "held as a shard"; }
  void zero_shard_grad(const Parameter&) override {}
};

std::shared_ptr<Parameter> parameter() {
  return std::make_shared<Parameter>(Tensor::zeros(DType::kFloat32, {2}, Device{DeviceType::kCpu, 0}), true);
}

TEST(ParameterOwner, ASecondClaimIsRefusedNamingTheOwnerUntilItReleases) {
  auto p = parameter();
  auto ddp = std::make_shared<Owner>();
  auto fsdp = std::make_shared<Sharding>();
  EXPECT_EQ(p->owner_kind(), nullptr);
  EXPECT_EQ(p->claim(ddp), "");
  EXPECT_STREQ(p->owner_kind(), "dp_ddp");
  EXPECT_EQ(p->claim(ddp), "");  // its own again
  EXPECT_EQ(p->claim(fsdp), "dp_ddp");
  EXPECT_EQ(p->sharding(), nullptr);
  p->release(fsdp.get());  // not the owner: nothing changes
  EXPECT_STREQ(p->owner_kind(), "dp_ddp");
  p->release(ddp.get());
  EXPECT_EQ(p->owner_kind(), nullptr);
  EXPECT_EQ(p->claim(fsdp), "");
  EXPECT_EQ(p->claim(std::make_shared<Owner>()), "dp_fsdp");
}

TEST(ParameterOwner, OnlyAShardingOwnerRefusesTheGradient) {
  auto p = parameter();
  auto ddp = std::make_shared<Owner>();
  ASSERT_EQ(p->claim(ddp), "");
  EXPECT_NO_THROW(p->grad());
  p->release(ddp.get());
  auto fsdp = std::make_shared<Sharding>();
  ASSERT_EQ(p->claim(fsdp), "");
  EXPECT_EQ(p->sharding(), fsdp);
  try {
    p->grad();
    ADD_FAILURE() << "grad() of a parameter held as a shard did not fail";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), StatusCode::kState);
    EXPECT_NE(std::string(e.what()).find("held as a shard"), std::string::npos) << e.what();
  }
}

TEST(ParameterOwner, AnOwnerThatEndsLetsGoOfTheParameter) {
  auto p = parameter();
  auto ddp = std::make_shared<Owner>();
  ASSERT_EQ(p->claim(ddp), "");
  ddp.reset();
  EXPECT_EQ(p->owner_kind(), nullptr);
  EXPECT_EQ(p->claim(std::make_shared<Sharding>()), "");
}

}  // namespace
}  // namespace dparallel
