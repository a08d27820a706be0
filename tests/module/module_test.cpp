#include <atomic>
#include <thread>

#include "module/module_test_util.h"

using namespace dptest;

namespace {

// root: fc1 (weight, bias), act (no tensors), fc2 (weight, bias), a buffer "steps".
ModulePtr two_layer() {
  ModulePtr root = new_module();
  auto fc1 = linear(3, 2);
  auto act = new_module();
  auto fc2 = linear(2, 1, 50.0f);
  EXPECT_EQ(dp_module_register_module(root.get(), "fc1", fc1.get()), DP_OK);
  EXPECT_EQ(dp_module_register_module(root.get(), "act", act.get()), DP_OK);
  EXPECT_EQ(dp_module_register_module(root.get(), "fc2", fc2.get()), DP_OK);
  auto steps = make<int64_t>({1}, {7});
  EXPECT_EQ(dp_module_register_buffer(root.get(), "steps", steps.get(), 1), DP_OK);
  return root;
}

}  // namespace

TEST(Module, NamesAreDottedInRegistrationOrderOwnFirst) {
  ModulePtr root = two_layer();
  auto scale = make<float>({1}, {2.0f});
  DP_ASSERT_OK(dp_module_register_parameter(root.get(), "scale", scale.get(), 1));
  // Like named_parameters(): the root's own parameters before its children's.
  EXPECT_EQ(parameter_names(root.get()),
            (std::vector<std::string>{"scale", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}));
  EXPECT_EQ(buffer_names(root.get()), (std::vector<std::string>{"steps"}));
  EXPECT_EQ(dp_module_num_parameters(root.get()), 5u);
  EXPECT_EQ(dp_module_num_buffers(root.get()), 1u);
}

TEST(Module, NameStaysValidWhileTheModuleLives) {
  ModulePtr root = two_layer();
  const char* name = nullptr;
  dp_tensor* t = nullptr;
  DP_ASSERT_OK(dp_module_parameter_at(root.get(), 2, &name, &t));
  TensorPtr held(t);
  auto extra = linear(1, 1);
  DP_ASSERT_OK(dp_module_register_module(root.get(), "fc3", extra.get()));  // relisting must not move old names
  EXPECT_EQ(dp_module_num_parameters(root.get()), 6u);
  EXPECT_STREQ(name, "fc2.weight");
}

TEST(Module, ParametersAreHeldByReference) {
  ModulePtr root = two_layer();
  auto w = parameter(root.get(), "fc1.weight");
  EXPECT_EQ(shape(w.get()), (std::vector<int64_t>{2, 3}));
  static_cast<float*>(dp_tensor_data(w.get()))[0] = 42.0f;
  auto again = parameter(root.get(), "fc1.weight");
  EXPECT_EQ(values<float>(again.get())[0], 42.0f);
  dp_module* child = nullptr;
  DP_ASSERT_OK(dp_module_get_module(root.get(), "fc1", &child));
  ModulePtr fc1(child);
  EXPECT_EQ(values<float>(parameter(fc1.get(), "weight").get())[0], 42.0f);
}

TEST(Module, SharedChildAndTiedParameterAreListedOnce) {
  ModulePtr root = shared_and_tied();
  EXPECT_EQ(parameter_names(root.get()), (std::vector<std::string>{"encoder.weight", "encoder.bias"}));
  // Every path resolves, and the tied parameter has one gradient.
  auto via_decoder = parameter(root.get(), "decoder.bias");
  EXPECT_EQ(dp_tensor_data(via_decoder.get()), dp_tensor_data(parameter(root.get(), "encoder.bias").get()));
  auto g1 = grad(root.get(), "encoder.weight");
  auto g2 = grad(root.get(), "head.weight");
  EXPECT_EQ(dp_tensor_data(g1.get()), dp_tensor_data(g2.get()));
}

TEST(Module, TyingWithAnotherRequiresGradIsRefused) {
  ModulePtr a = new_module(), b = new_module();
  auto w = make<float>({2}, {1, 2});
  DP_ASSERT_OK(dp_module_register_parameter(a.get(), "w", w.get(), 1));
  EXPECT_EQ(dp_module_register_parameter(b.get(), "w", w.get(), 0), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "already a parameter with requires_grad=1")) << last_error();
}

TEST(Module, NullSlotsAreKeptButNotListed) {
  ModulePtr root = new_module();
  auto w = make<float>({1}, {1});
  DP_ASSERT_OK(dp_module_register_parameter(root.get(), "bias", nullptr, 1));
  DP_ASSERT_OK(dp_module_register_parameter(root.get(), "weight", w.get(), 1));
  DP_ASSERT_OK(dp_module_register_buffer(root.get(), "mask", nullptr, 1));
  DP_ASSERT_OK(dp_module_register_module(root.get(), "extra", nullptr));
  EXPECT_EQ(parameter_names(root.get()), (std::vector<std::string>{"weight"}));
  EXPECT_EQ(dp_module_num_buffers(root.get()), 0u);
  dp_tensor* t = reinterpret_cast<dp_tensor*>(1);
  DP_EXPECT_OK(dp_module_get_parameter(root.get(), "bias", &t));
  EXPECT_EQ(t, nullptr);
  DP_EXPECT_OK(dp_module_get_buffer(root.get(), "mask", &t));
  EXPECT_EQ(t, nullptr);
  dp_module* m = reinterpret_cast<dp_module*>(1);
  DP_EXPECT_OK(dp_module_get_module(root.get(), "extra", &m));
  EXPECT_EQ(m, nullptr);
  EXPECT_EQ(dp_module_grad(root.get(), "bias", &t), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "NULL slot")) << last_error();
  // A name taken by a NULL slot stays taken.
  EXPECT_EQ(dp_module_register_buffer(root.get(), "bias", w.get(), 1), DP_EINVAL);
}

TEST(Module, GradIsZeroedOnFirstUseThenTheSameStorage) {
  ModulePtr root = two_layer();
  auto g = grad(root.get(), "fc1.weight");
  EXPECT_EQ(values<float>(g.get()), std::vector<float>(6, 0.0f));
  EXPECT_EQ(shape(g.get()), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(dp_tensor_dtype(g.get()), DP_FLOAT32);
  static_cast<float*>(dp_tensor_data(g.get()))[1] = 3.0f;
  auto again = grad(root.get(), "fc1.weight");
  EXPECT_EQ(dp_tensor_data(again.get()), dp_tensor_data(g.get()));
  EXPECT_EQ(values<float>(again.get())[1], 3.0f);
  DP_ASSERT_OK(dp_module_zero_grad(root.get()));
  EXPECT_EQ(values<float>(g.get()), std::vector<float>(6, 0.0f));
  EXPECT_EQ(dp_tensor_data(grad(root.get(), "fc1.weight").get()), dp_tensor_data(g.get()));
}

TEST(Module, RequiresGradIsReadAndSetByName) {
  ModulePtr root = two_layer();
  int flag = -1;
  DP_ASSERT_OK(dp_module_requires_grad(root.get(), "fc2.bias", &flag));
  EXPECT_EQ(flag, 1);
  DP_ASSERT_OK(dp_module_requires_grad(root.get(), "steps", &flag));
  EXPECT_EQ(flag, 0);
  DP_ASSERT_OK(dp_module_set_requires_grad(root.get(), "fc2.bias", 0));
  DP_ASSERT_OK(dp_module_set_requires_grad(root.get(), "steps", 1));
  DP_ASSERT_OK(dp_module_requires_grad(root.get(), "fc2.bias", &flag));
  EXPECT_EQ(flag, 0);
  DP_ASSERT_OK(dp_module_requires_grad(root.get(), "steps", &flag));
  EXPECT_EQ(flag, 1);
}

TEST(Module, UnknownNamesAreNamedInTheError) {
  ModulePtr root = two_layer();
  dp_tensor* t = nullptr;
  EXPECT_EQ(dp_module_get_parameter(root.get(), "fc3.weight", &t), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "\"fc3\"")) << last_error();
  EXPECT_EQ(dp_module_get_parameter(root.get(), "fc1.gain", &t), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "no parameter named \"fc1.gain\"")) << last_error();
  EXPECT_EQ(dp_module_get_buffer(root.get(), "fc1.weight", &t), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "no buffer named \"fc1.weight\"")) << last_error();
  EXPECT_EQ(dp_module_grad(root.get(), "nope", &t), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "\"nope\"")) << last_error();
  dp_module* m = nullptr;
  EXPECT_EQ(dp_module_get_module(root.get(), "fc1.weight", &m), DP_EINVAL);
  EXPECT_EQ(m, nullptr);
  int flag = 0;
  EXPECT_EQ(dp_module_set_requires_grad(root.get(), "act.x", 1), DP_EINVAL);
  EXPECT_EQ(dp_module_requires_grad(root.get(), "act.x", &flag), DP_EINVAL);
  EXPECT_EQ(t, nullptr);
}

TEST(Module, EmptyNameIsTheModuleItself) {
  ModulePtr root = two_layer();
  dp_module* self = nullptr;
  DP_ASSERT_OK(dp_module_get_module(root.get(), "", &self));
  ModulePtr held(self);
  EXPECT_EQ(dp_module_num_parameters(self), 4u);
}

TEST(Module, BadRegistrationsAreRefused) {
  ModulePtr root = two_layer();
  auto t = make<float>({1}, {1});
  EXPECT_EQ(dp_module_register_parameter(root.get(), "fc1", t.get(), 1), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "already has a parameter, buffer or child named \"fc1\"")) << last_error();
  EXPECT_EQ(dp_module_register_parameter(root.get(), "a.b", t.get(), 1), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "must not contain '.'")) << last_error();
  EXPECT_EQ(dp_module_register_buffer(root.get(), "", t.get(), 1), DP_EINVAL);
  EXPECT_EQ(dp_module_register_parameter(root.get(), nullptr, t.get(), 1), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "'name' is NULL")) << last_error();
  EXPECT_EQ(dp_module_register_parameter(nullptr, "x", t.get(), 1), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "'module' is NULL")) << last_error();
  dp_module* fc1 = nullptr;
  DP_ASSERT_OK(dp_module_get_module(root.get(), "fc1", &fc1));
  ModulePtr child(fc1);
  EXPECT_EQ(dp_module_register_module(fc1, "loop", root.get()), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "cycle")) << last_error();
  EXPECT_EQ(dp_module_register_module(root.get(), "self", root.get()), DP_EINVAL);
  // A tensor handle is not a module handle.
  EXPECT_EQ(dp_module_register_module(root.get(), "x", reinterpret_cast<dp_module*>(t.get())), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "not a dp_module handle")) << last_error();
  EXPECT_EQ(dp_module_num_parameters(root.get()), 4u);
}

TEST(Module, IndexOutOfRangeAndNullHandles) {
  ModulePtr root = two_layer();
  dp_tensor* t = nullptr;
  EXPECT_EQ(dp_module_parameter_at(root.get(), 4, nullptr, &t), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "'index' is 4 but the module has 4 parameters")) << last_error();
  EXPECT_EQ(dp_module_buffer_at(root.get(), 1, nullptr, &t), DP_EINVAL);
  EXPECT_EQ(dp_module_parameter_at(root.get(), 0, nullptr, nullptr), DP_EINVAL);
  EXPECT_EQ(dp_module_num_parameters(nullptr), 0u);
  EXPECT_EQ(dp_module_zero_grad(nullptr), DP_EINVAL);
  dp_module_destroy(nullptr);
  EXPECT_EQ(dp_module_create(nullptr), DP_EINVAL);
}

TEST(Module, ChildOutlivesItsHandleThroughTheParent) {
  ModulePtr root = new_module();
  {
    auto fc = linear(2, 2, 5.0f);
    DP_ASSERT_OK(dp_module_register_module(root.get(), "fc", fc.get()));
  }
  EXPECT_EQ(values<float>(parameter(root.get(), "fc.weight").get()), iota<float>(4, 5.0f));
}

// Readers of one module keep working while other threads register into
// unrelated modules (which makes every module relist).
TEST(Module, ReadingWhileOtherModulesChangeIsSafe) {
  ModulePtr root = two_layer();
  std::atomic<bool> stop{false};
  std::thread writer([&] {
    for (int i = 0; i < 300 && !stop.load(); ++i) {
      ModulePtr other = new_module();
      auto t = make<float>({1}, {1});
      EXPECT_EQ(dp_module_register_parameter(other.get(), "p", t.get(), 1), DP_OK);
    }
  });
  for (int i = 0; i < 300; ++i) {
    ASSERT_EQ(dp_module_num_parameters(root.get()), 4u);
    const char* name = nullptr;
    dp_tensor* t = nullptr;
    ASSERT_EQ(dp_module_parameter_at(root.get(), 3, &name, &t), DP_OK) << dp_last_error();
    dp_tensor_destroy(t);
    ASSERT_STREQ(name, "fc2.bias");
  }
  stop = true;
  writer.join();
}

TEST(Module, ConcurrentFirstGradCallsAgreeOnOneTensor) {
  ModulePtr root = two_layer();
  std::vector<void*> seen(4, nullptr);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < seen.size(); ++i) {
    threads.emplace_back([&, i] {
      dp_tensor* g = nullptr;
      if (dp_module_grad(root.get(), "fc1.weight", &g) == DP_OK) seen[i] = dp_tensor_data(g);
      dp_tensor_destroy(g);
    });
  }
  for (auto& t : threads) t.join();
  for (void* p : seen) EXPECT_EQ(p, seen[0]);
  EXPECT_NE(seen[0], nullptr);
}
