#include "module/module_test_util.h"

using namespace dptest;

namespace {

struct Replicas {
  std::vector<ModulePtr> modules;
  dp_module* operator[](size_t i) const { return modules[i].get(); }
};

Replicas replicate(const dp_module* m, const std::vector<dp_device>& devices, int detach) {
  std::vector<dp_module*> out(devices.size(), nullptr);
  EXPECT_EQ(dp_replicate(m, devices.data(), devices.size(), detach, out.data()), DP_OK) << dp_last_error();
  Replicas r;
  for (dp_module* p : out) r.modules.emplace_back(p);
  return r;
}

// root: fc (Linear 3->2), a persistent buffer "running" that requires grad,
// a non-persistent buffer "scratch", and a NULL parameter slot "unused".
ModulePtr model() {
  ModulePtr root = new_module();
  auto fc = linear(3, 2, 1.0f);
  EXPECT_EQ(dp_module_register_module(root.get(), "fc", fc.get()), DP_OK);
  auto running = make<float>({2}, {0.5f, 1.5f});
  EXPECT_EQ(dp_module_register_buffer(root.get(), "running", running.get(), 1), DP_OK);
  EXPECT_EQ(dp_module_set_requires_grad(root.get(), "running", 1), DP_OK);
  auto scratch = make<int32_t>({3}, {7, 8, 9});
  EXPECT_EQ(dp_module_register_buffer(root.get(), "scratch", scratch.get(), 0), DP_OK);
  EXPECT_EQ(dp_module_register_parameter(root.get(), "unused", nullptr, 1), DP_OK);
  return root;
}

int requires_grad(const dp_module* m, const char* name) {
  int flag = -1;
  EXPECT_EQ(dp_module_requires_grad(m, name, &flag), DP_OK) << dp_last_error();
  return flag;
}

void fill(dp_tensor* t, float value) {
  std::vector<float> v(static_cast<size_t>(dp_tensor_numel(t)), value);
  EXPECT_EQ(dp_tensor_copy_from_host(t, v.data(), v.size() * sizeof(float)), DP_OK);
}

}  // namespace

TEST(Replicate, ReplicasHaveTheStructureNamesAndValuesOnTheirDevices) {
  ModulePtr m = model();
  Replicas r = replicate(m.get(), {cpu(0), cpu(1), cpu(2)}, 0);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(parameter_names(r[i]), parameter_names(m.get()));
    EXPECT_EQ(buffer_names(r[i]), (std::vector<std::string>{"running", "scratch"}));
    auto w = parameter(r[i], "fc.weight");
    EXPECT_TRUE(same_device(dp_tensor_device(w.get()), cpu(static_cast<int>(i))));
    EXPECT_EQ(values<float>(w.get()), iota<float>(6, 1.0f));
    dp_tensor* scratch = nullptr;
    DP_ASSERT_OK(dp_module_get_buffer(r[i], "scratch", &scratch));
    EXPECT_EQ(values<int32_t>(scratch), (std::vector<int32_t>{7, 8, 9}));
    EXPECT_TRUE(same_device(dp_tensor_device(scratch), cpu(static_cast<int>(i))));
    dp_tensor_destroy(scratch);
    dp_tensor* unused = reinterpret_cast<dp_tensor*>(1);
    DP_ASSERT_OK(dp_module_get_parameter(r[i], "unused", &unused));
    EXPECT_EQ(unused, nullptr);  // a NULL slot stays NULL
  }
  // The replica on the module's device shares its storage; the others do not.
  auto w = parameter(m.get(), "fc.weight");
  EXPECT_EQ(dp_tensor_data(parameter(r[0], "fc.weight").get()), dp_tensor_data(w.get()));
  EXPECT_NE(dp_tensor_data(parameter(r[1], "fc.weight").get()), dp_tensor_data(w.get()));
}

TEST(Replicate, EveryReplicaHasItsOwnGradients) {
  ModulePtr m = model();
  Replicas r = replicate(m.get(), {cpu(0), cpu(1)}, 0);
  auto g = grad(m.get(), "fc.bias");
  auto g0 = grad(r[0], "fc.bias");
  auto g1 = grad(r[1], "fc.bias");
  EXPECT_NE(dp_tensor_data(g0.get()), dp_tensor_data(g.get()));
  EXPECT_NE(dp_tensor_data(g0.get()), dp_tensor_data(g1.get()));
}

TEST(Replicate, RequiresGradFollowsUnlessDetached) {
  ModulePtr m = model();
  DP_ASSERT_OK(dp_module_set_requires_grad(m.get(), "fc.bias", 0));
  Replicas kept = replicate(m.get(), {cpu(1)}, 0);
  EXPECT_EQ(requires_grad(kept[0], "fc.weight"), 1);
  EXPECT_EQ(requires_grad(kept[0], "fc.bias"), 0);
  EXPECT_EQ(requires_grad(kept[0], "running"), 1);  // a buffer that requires grad follows the parameters
  EXPECT_EQ(requires_grad(kept[0], "scratch"), 0);
  Replicas detached = replicate(m.get(), {cpu(1)}, 1);
  EXPECT_EQ(requires_grad(detached[0], "fc.weight"), 0);
  EXPECT_EQ(requires_grad(detached[0], "running"), 0);
  dp_tensor* running = nullptr;
  DP_ASSERT_OK(dp_module_get_buffer(detached[0], "running", &running));
  EXPECT_EQ(values<float>(running), (std::vector<float>{0.5f, 1.5f}));
  dp_tensor_destroy(running);
  // The original is untouched.
  EXPECT_EQ(requires_grad(m.get(), "fc.weight"), 1);
}

TEST(Replicate, SharedChildrenStaySharedInsideEachReplica) {
  ModulePtr root = shared_and_tied();
  Replicas r = replicate(root.get(), {cpu(1), cpu(2)}, 0);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(parameter_names(r[i]), (std::vector<std::string>{"encoder.weight", "encoder.bias"}));
    dp_module *enc = nullptr, *dec = nullptr;
    DP_ASSERT_OK(dp_module_get_module(r[i], "encoder", &enc));
    DP_ASSERT_OK(dp_module_get_module(r[i], "decoder", &dec));
    ModulePtr e(enc), d(dec);
    auto ew = parameter(enc, "weight");
    EXPECT_EQ(dp_tensor_data(ew.get()), dp_tensor_data(parameter(dec, "weight").get()));
    EXPECT_EQ(dp_tensor_data(ew.get()), dp_tensor_data(parameter(r[i], "head.weight").get()));
    EXPECT_EQ(dp_tensor_data(grad(r[i], "head.weight").get()), dp_tensor_data(grad(enc, "weight").get()));
  }
}

TEST(Replicate, EmptyDeviceListYieldsNoReplicas) {
  ModulePtr m = model();
  DP_EXPECT_OK(dp_replicate(m.get(), nullptr, 0, 0, nullptr));
}

TEST(Replicate, ModuleOnSeveralDevicesIsRefused) {
  ModulePtr root = new_module();
  auto a = linear(1, 1, 0.0f, cpu(0));
  auto b = linear(1, 1, 0.0f, cpu(3));
  DP_ASSERT_OK(dp_module_register_module(root.get(), "a", a.get()));
  DP_ASSERT_OK(dp_module_register_module(root.get(), "b", b.get()));
  dp_device devices[] = {cpu(0), cpu(1)};
  dp_module* out[2] = {reinterpret_cast<dp_module*>(1), reinterpret_cast<dp_module*>(1)};
  EXPECT_EQ(dp_replicate(root.get(), devices, 2, 0, out), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "\"a.weight\" is on cpu:0 but \"b.weight\" is on cpu:3")) << last_error();
  EXPECT_EQ(out[0], nullptr);
  EXPECT_EQ(out[1], nullptr);
  EXPECT_EQ(dp_replicate(root.get(), devices, 2, 0, nullptr), DP_EINVAL);
  dp_device bad[] = {cpu(0), {7, 0}};
  EXPECT_EQ(dp_replicate(a.get(), bad, 2, 0, out), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "devices[1]")) << last_error();
}

TEST(ReduceGradients, TargetGetsItsOldValuePlusTheSumOfTheReplicas) {
  ModulePtr m = model();
  Replicas r = replicate(m.get(), {cpu(0), cpu(1), cpu(2)}, 0);
  fill(grad(m.get(), "fc.weight").get(), 0.5f);
  fill(grad(r[0], "fc.weight").get(), 1.0f);
  fill(grad(r[1], "fc.weight").get(), 2.0f);
  fill(grad(r[2], "fc.weight").get(), 4.0f);
  fill(grad(r[1], "fc.bias").get(), 3.0f);  // the others never allocated theirs: they add nothing
  dp_module* replicas[] = {r[0], r[1], r[2]};
  DP_ASSERT_OK(dp_reduce_gradients(replicas, 3, m.get()));
  EXPECT_EQ(values<float>(grad(m.get(), "fc.weight").get()), std::vector<float>(6, 7.5f));
  EXPECT_EQ(values<float>(grad(m.get(), "fc.bias").get()), std::vector<float>(2, 3.0f));
  EXPECT_TRUE(same_device(dp_tensor_device(grad(m.get(), "fc.weight").get()), cpu(0)));
  // Each replica's gradient counts once, even the one sharing the module's storage.
  DP_ASSERT_OK(dp_reduce_gradients(replicas, 3, m.get()));
  EXPECT_EQ(values<float>(grad(m.get(), "fc.weight").get()), std::vector<float>(6, 14.5f));
}

TEST(ReduceGradients, SkipsWhatDoesNotRequireGrad) {
  ModulePtr m = model();
  Replicas detached = replicate(m.get(), {cpu(1)}, 1);
  fill(grad(detached[0], "fc.weight").get(), 1.0f);
  dp_module* replicas[] = {detached[0]};
  DP_ASSERT_OK(dp_reduce_gradients(replicas, 1, m.get()));
  EXPECT_EQ(values<float>(grad(m.get(), "fc.weight").get()), std::vector<float>(6, 0.0f));
  Replicas kept = replicate(m.get(), {cpu(1)}, 0);
  DP_ASSERT_OK(dp_module_set_requires_grad(m.get(), "fc.bias", 0));
  fill(grad(kept[0], "fc.bias").get(), 1.0f);
  replicas[0] = kept[0];
  DP_ASSERT_OK(dp_reduce_gradients(replicas, 1, m.get()));
  EXPECT_EQ(values<float>(grad(m.get(), "fc.bias").get()), std::vector<float>(2, 0.0f));
}

TEST(ReduceGradients, StructureSizesAndDtypesAreChecked) {
  ModulePtr m = model();
  ModulePtr other = linear(2, 2);
  ModulePtr wrapped = new_module();
  DP_ASSERT_OK(dp_module_register_module(wrapped.get(), "fc", other.get()));
  dp_module* replicas[] = {wrapped.get()};
  EXPECT_EQ(dp_reduce_gradients(replicas, 1, m.get()), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(),
                       "replicas[0] parameter 0 is \"fc.weight\" (float32 2x2) but the target's is "
                       "\"fc.weight\" (float32 2x3)"))
      << last_error();
  ModulePtr small = new_module();
  replicas[0] = small.get();
  EXPECT_EQ(dp_reduce_gradients(replicas, 1, m.get()), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "replicas[0] has 0 parameters but the target has 2")) << last_error();
  ModulePtr doubles = new_module();
  auto w = make<double>({2, 3}, {});
  auto b = make<double>({2}, {});
  ModulePtr fc = new_module();
  DP_ASSERT_OK(dp_module_register_parameter(fc.get(), "weight", w.get(), 1));
  DP_ASSERT_OK(dp_module_register_parameter(fc.get(), "bias", b.get(), 1));
  DP_ASSERT_OK(dp_module_register_module(doubles.get(), "fc", fc.get()));
  replicas[0] = doubles.get();
  EXPECT_EQ(dp_reduce_gradients(replicas, 1, m.get()), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "(float64 2x3)")) << last_error();
  replicas[0] = nullptr;
  EXPECT_EQ(dp_reduce_gradients(replicas, 1, m.get()), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "'replicas[0]' is NULL")) << last_error();
}

TEST(ReplicaSet, SyncRefreshesReplicasInPlace) {
  ModulePtr m = model();
  ReplicaSetPtr set = replica_set(m.get(), {cpu(0), cpu(1)});
  EXPECT_EQ(dp_replica_set_size(set.get()), 2u);
  dp_module* r1 = nullptr;
  DP_ASSERT_OK(dp_replica_set_replica(set.get(), 1, &r1));
  ModulePtr replica(r1);
  auto before = parameter(r1, "fc.weight");
  void* storage = dp_tensor_data(before.get());
  fill(parameter(m.get(), "fc.weight").get(), 9.0f);
  dp_tensor* running = nullptr;
  DP_ASSERT_OK(dp_module_get_buffer(m.get(), "running", &running));
  fill(running, -1.0f);
  dp_tensor_destroy(running);
  EXPECT_EQ(values<float>(before.get()), iota<float>(6, 1.0f));
  DP_ASSERT_OK(dp_replica_set_sync(set.get()));
  auto after = parameter(r1, "fc.weight");
  EXPECT_EQ(dp_tensor_data(after.get()), storage);
  EXPECT_EQ(values<float>(after.get()), std::vector<float>(6, 9.0f));
  DP_ASSERT_OK(dp_module_get_buffer(r1, "running", &running));
  EXPECT_EQ(values<float>(running), std::vector<float>(2, -1.0f));
  dp_tensor_destroy(running);
}

TEST(ReplicaSet, ReduceGradientsAddsIntoTheModule) {
  ModulePtr m = model();
  ReplicaSetPtr set = replica_set(m.get(), {cpu(0), cpu(1)});
  for (size_t i = 0; i < 2; ++i) {
    dp_module* r = nullptr;
    DP_ASSERT_OK(dp_replica_set_replica(set.get(), i, &r));
    ModulePtr held(r);
    fill(grad(r, "fc.bias").get(), static_cast<float>(i + 1));
  }
  DP_ASSERT_OK(dp_replica_set_reduce_gradients(set.get()));
  EXPECT_EQ(values<float>(grad(m.get(), "fc.bias").get()), std::vector<float>(2, 3.0f));
}

TEST(ReplicaSet, ErrorsNameTheProblem) {
  ModulePtr m = model();
  dp_device devices[] = {cpu(0), cpu(1)};
  dp_replica_set* raw = reinterpret_cast<dp_replica_set*>(1);
  EXPECT_EQ(dp_replica_set_create(&raw, m.get(), devices, 0), DP_EINVAL);
  EXPECT_EQ(raw, nullptr);
  EXPECT_TRUE(contains(last_error(), "'ndevices' is 0")) << last_error();
  DP_ASSERT_OK(dp_replica_set_create(&raw, m.get(), devices, 2));
  ReplicaSetPtr set(raw);
  dp_module* r = nullptr;
  EXPECT_EQ(dp_replica_set_replica(set.get(), 2, &r), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "'index' is 2 but the replica set has 2 replicas")) << last_error();
  auto extra = make<float>({1}, {1});
  DP_ASSERT_OK(dp_module_register_parameter(m.get(), "late", extra.get(), 1));
  EXPECT_EQ(dp_replica_set_sync(set.get()), DP_ESTATE);
  EXPECT_TRUE(contains(last_error(), "changed since the replica set was made")) << last_error();
  EXPECT_EQ(dp_replica_set_sync(nullptr), DP_EINVAL);
  EXPECT_EQ(dp_replica_set_sync(reinterpret_cast<dp_replica_set*>(m.get())), DP_EINVAL);
  EXPECT_TRUE(contains(last_error(), "not a dp_replica_set handle")) << last_error();
  EXPECT_EQ(dp_replica_set_size(nullptr), 0u);
  dp_replica_set_destroy(nullptr);
}
