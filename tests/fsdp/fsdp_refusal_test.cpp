// A dp_fsdp call refused on one rank still takes its collective's place:
// the other ranks' matching call fails at once naming that rank, and every
// rank goes on in step. The wrong gradient is set here through the module
// itself, past dp_module_set_grad's checks, so the test links the library's
// internals. Ranks are threads of this process, each with its own group.
#include <gtest/gtest.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "capi/capi_internal.h"
#include "core/tensor.h"
#include "thread_ranks.h"

using dptest::make;
using dptest::TensorPtr;

namespace {

std::vector<float> read(const dp_tensor* t) {
  std::vector<float> out(static_cast<size_t>(dp_tensor_numel(t)));
  EXPECT_EQ(dp_tensor_copy_to_host(t, out.data(), out.size() * sizeof(float)), DP_OK) << dp_last_error();
  return out;
}

// The full gradient of "weight", written through dp_module_grad.
void set_full_grad(dp_module* m, float value) {
  dp_tensor* g = nullptr;
  ASSERT_EQ(dp_module_grad(m, "weight", &g), DP_OK) << dp_last_error();
  TensorPtr owned(g);
  std::vector<float> v(static_cast<size_t>(dp_tensor_numel(g)), value);
  ASSERT_EQ(dp_tensor_copy_from_host(g, v.data(), v.size() * sizeof(float)), DP_OK) << dp_last_error();
}

// A gradient of "weight" of another shape than its full value, set through
// the module itself.
void set_grad_of_another_shape(dp_module* m) {
  auto parameter = m->module->get_parameter("weight");
  parameter->set_grad(dparallel::Tensor::zeros(dparallel::DType::kFloat32, {2, 3}, parameter->value().device()));
}

// An iteration of two ranks whose full gradients are rank + 1: each
// shard's gradient is their average.
void expect_an_iteration_reduces(dp_fsdp* f, dp_module* m, int rank) {
  ASSERT_EQ(dp_fsdp_unshard(f, 0), DP_OK) << dp_last_error();
  set_full_grad(m, static_cast<float>(rank + 1));
  ASSERT_EQ(dp_fsdp_post_backward(f), DP_OK) << dp_last_error();
  ASSERT_EQ(dp_fsdp_finish_backward(f), DP_OK) << dp_last_error();
  dp_tensor* g = nullptr;
  ASSERT_EQ(dp_fsdp_shard_grad(f, 0, &g), DP_OK) << dp_last_error();
  TensorPtr owned(g);
  EXPECT_EQ(read(g), std::vector<float>(6, 1.5f));
}

}  // namespace

// Rank 1's post_backward finds a gradient of another shape: it fails
// (DP_EINVAL naming the parameter), rank 0's reduce-scatter fails with it
// instead of pairing with rank 1's next unshard, both end resharded, and the
// next iteration reduces as usual. The group's timeout is past the test's
// limit, so a rank left waiting shows as a timeout of the test.
TEST(FsdpRefusal, APostBackwardRefusedOnOneRankFailsTheOthersNamingItAndTheNextIterationReduces) {
  dptest::run_thread_ranks(
      "fsdp_refusal_", 2, dptest::RankOptions{DP_BACKEND_GLOO, 120000}, [](int rank, dp_process_group* pg) {
        dptest::ModulePtr m = dptest::new_module();
        TensorPtr w = make<float>({4, 3}, std::vector<float>(12, 0.5f));
        ASSERT_EQ(dp_module_register_parameter(m.get(), "weight", w.get(), 1), DP_OK) << dp_last_error();
        dp_fsdp* f = nullptr;
        ASSERT_EQ(dp_fsdp_create(&f, m.get(), pg, nullptr), DP_OK) << dp_last_error();
        ASSERT_EQ(dp_fsdp_unshard(f, 0), DP_OK) << dp_last_error();
        if (rank == 1) {
          set_grad_of_another_shape(m.get());
          EXPECT_EQ(dp_fsdp_post_backward(f), DP_EINVAL);
          std::string error = dp_last_error();
          EXPECT_NE(error.find("rank 1 refused"), std::string::npos) << error;
          EXPECT_NE(error.find("'weight'"), std::string::npos) << error;
          EXPECT_EQ(dp_fsdp_finish_backward(f), DP_OK) << dp_last_error();
        } else {
          set_full_grad(m.get(), 1.0f);
          ASSERT_EQ(dp_fsdp_post_backward(f), DP_OK) << dp_last_error();
          EXPECT_EQ(dp_fsdp_finish_backward(f), DP_EINVAL);
          std::string error = dp_last_error();
          EXPECT_NE(error.find("rank 1 refused"), std::string::npos) << error;
          EXPECT_NE(error.find("'weight'"), std::string::npos) << error;
        }
        // Both resharded, nothing reduced: the next iteration pairs and reduces.
        expect_an_iteration_reduces(f, m.get(), rank);
        dp_fsdp_destroy(f);
      });
}

// Rank 0's host does not call dp_fsdp_finish_backward after its
// post_backward job failed with rank 1's refusal: its next post_backward
// reports that failure, in that post_backward's place (rank 1's
// finish_backward then fails naming rank 0), and both still reshard, so the
// iteration after that pairs and reduces.
TEST(FsdpRefusal, AFailureNotWaitedForFailsTheNextPostBackwardInItsPlaceAndTheRanksStayInStep) {
  dptest::run_thread_ranks(
      "fsdp_refusal_", 2, dptest::RankOptions{DP_BACKEND_GLOO, 120000}, [](int rank, dp_process_group* pg) {
        dptest::ModulePtr m = dptest::new_module();
        TensorPtr w = make<float>({4, 3}, std::vector<float>(12, 0.5f));
        ASSERT_EQ(dp_module_register_parameter(m.get(), "weight", w.get(), 1), DP_OK) << dp_last_error();
        dp_fsdp* f = nullptr;
        ASSERT_EQ(dp_fsdp_create(&f, m.get(), pg, nullptr), DP_OK) << dp_last_error();
        ASSERT_EQ(dp_fsdp_unshard(f, 0), DP_OK) << dp_last_error();
        if (rank == 1) {
          set_grad_of_another_shape(m.get());
          EXPECT_EQ(dp_fsdp_post_backward(f), DP_EINVAL);
        } else {
          set_full_grad(m.get(), 1.0f);
          ASSERT_EQ(dp_fsdp_post_backward(f), DP_OK) << dp_last_error();
        }
        // The next iteration; rank 0 has not seen its job fail.
        ASSERT_EQ(dp_fsdp_unshard(f, 0), DP_OK) << dp_last_error();
        set_full_grad(m.get(), 1.0f);
        if (rank == 0) {
          EXPECT_EQ(dp_fsdp_post_backward(f), DP_EINVAL);
          std::string error = dp_last_error();
          EXPECT_NE(error.find("the previous post_backward failed"), std::string::npos) << error;
          EXPECT_NE(error.find("rank 1 refused"), std::string::npos) << error;
          EXPECT_EQ(dp_fsdp_finish_backward(f), DP_OK) << dp_last_error();
        } else {
          ASSERT_EQ(dp_fsdp_post_backward(f), DP_OK) << dp_last_error();
          EXPECT_EQ(dp_fsdp_finish_backward(f), DP_EINVAL);
          std::string error = dp_last_error();
          EXPECT_NE(error.find("rank 0 refused"), std::string::npos) << error;
        }
        expect_an_iteration_reduces(f, m.get(), rank);
        dp_fsdp_destroy(f);
      });
}

// Rank 0's post_backward job fails with rank 1's refusal and its host goes
// straight to dp_fsdp_destroy: the failure is reported there, and the
// destroy still gathers with rank 1's, so both get the full parameters back
// (rank 1's destroy is not left waiting for a gather rank 0 skipped).
TEST(FsdpRefusal, ADestroyAfterAPeersRefusalStillGathersWithTheOtherRanks) {
  dptest::run_thread_ranks(
      "fsdp_refusal_", 2, dptest::RankOptions{DP_BACKEND_GLOO, 120000}, [](int rank, dp_process_group* pg) {
        dptest::ModulePtr m = dptest::new_module();
        std::vector<float> values(12);
        for (size_t k = 0; k < values.size(); ++k) values[k] = static_cast<float>(k);
        TensorPtr w = make<float>({4, 3}, values);
        ASSERT_EQ(dp_module_register_parameter(m.get(), "weight", w.get(), 1), DP_OK) << dp_last_error();
        dp_fsdp* f = nullptr;
        ASSERT_EQ(dp_fsdp_create(&f, m.get(), pg, nullptr), DP_OK) << dp_last_error();
        ASSERT_EQ(dp_fsdp_unshard(f, 0), DP_OK) << dp_last_error();
        if (rank == 1) {
          set_grad_of_another_shape(m.get());
          EXPECT_EQ(dp_fsdp_post_backward(f), DP_EINVAL);
        } else {
          set_full_grad(m.get(), 1.0f);
          ASSERT_EQ(dp_fsdp_post_backward(f), DP_OK) << dp_last_error();
        }
        dp_fsdp_destroy(f);
        if (rank == 0) {
          std::string error = dp_last_error();
          EXPECT_NE(error.find("rank 1 refused"), std::string::npos) << error;
        }
        dp_tensor* p = nullptr;
        ASSERT_EQ(dp_module_get_parameter(m.get(), "weight", &p), DP_OK) << dp_last_error();
        TensorPtr full(p);
        EXPECT_EQ(read(p), values);
      });
}

namespace {

// Rank 1 alone passes a NULL path to the full state dict save: every rank's
// save fails at once naming rank 1 and the argument (rank 0 is not left in
// its gather, or, for a 0-d parameter that is gathered without one, in the
// exchange of rank 0's outcome), and a save with good arguments then works
// on every rank.
void expect_null_path_refused_on_every_rank(const std::vector<int64_t>& shape) {
  const std::string path = dptest::temp_path("fsdp_refusal_", "full.safetensors");
  ::unlink(path.c_str());
  dptest::run_thread_ranks(
      "fsdp_refusal_", 2, dptest::RankOptions{DP_BACKEND_GLOO, 120000}, [&](int rank, dp_process_group* pg) {
        dptest::ModulePtr m = dptest::new_module();
        size_t numel = 1;
        for (int64_t d : shape) numel *= static_cast<size_t>(d);
        TensorPtr w = make<float>(shape, std::vector<float>(numel, 0.5f));
        ASSERT_EQ(dp_module_register_parameter(m.get(), "weight", w.get(), 1), DP_OK) << dp_last_error();
        dp_fsdp* f = nullptr;
        ASSERT_EQ(dp_fsdp_create(&f, m.get(), pg, nullptr), DP_OK) << dp_last_error();
        EXPECT_EQ(dp_fsdp_save_full_state_dict(m.get(), pg, rank == 1 ? nullptr : path.c_str()), DP_EINVAL);
        std::string error = dp_last_error();
        EXPECT_NE(error.find("rank 1 refused"), std::string::npos) << error;
        EXPECT_NE(error.find("'path'"), std::string::npos) << error;
        // A sharded parameter's gather fails before rank 0 writes.
        if (!shape.empty()) {
          EXPECT_EQ(::access(path.c_str(), F_OK), -1) << "rank 0 wrote the file of a refused save";
        }
        ASSERT_EQ(dp_fsdp_save_full_state_dict(m.get(), pg, path.c_str()), DP_OK) << dp_last_error();
        dp_fsdp_destroy(f);
      });
  EXPECT_EQ(::access(path.c_str(), F_OK), 0);
  ::unlink(path.c_str());
}

}  // namespace

TEST(FsdpRefusal, ANullPathOnOneRankFailsEveryRanksFullSaveNamingItAndTheNextSaveWorks) {
  expect_null_path_refused_on_every_rank({4, 3});
}

TEST(FsdpRefusal, ANullPathOnOneRankFailsEveryRanksFullSaveOfAZeroDimParameterToo) {
  expect_null_path_refused_on_every_rank({});
}
