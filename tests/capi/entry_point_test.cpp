// What every entry point does before its work, seen through the C ABI: a
// failed call leaves a handle out-parameter NULL and a value out-parameter
// as it was (dp_base.h).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "dparallel/dparallel.h"

namespace {

constexpr dp_device kNoDevice{99, 0};

// Calls `call` with *out set to a non-NULL value no call makes; the call
// must fail and leave *out NULL.
template <typename Handle, typename Call>
void expect_out_nulled(const char* what, Call call) {
  static unsigned char junk[64];
  Handle* out = reinterpret_cast<Handle*>(junk);
  EXPECT_NE(call(&out), DP_OK) << what;
  EXPECT_EQ(out, nullptr) << what << ": *out was not set to NULL (" << dp_last_error() << ")";
}

int forward_never_called(void*, size_t, dp_module*, dp_tensor*, dp_device, dp_tensor**) { return 1; }

}  // namespace

TEST(CapiEntryPoints, AFailedCallLeavesItsHandleOutNull) {
  const int64_t shape[] = {2};
  float data[2] = {};
  expect_out_nulled<dp_tensor>("dp_tensor_create", [&](dp_tensor** out) {
    return dp_tensor_create(out, 99, 1, shape, dp_device{DP_DEVICE_CPU, 0});
  });
  expect_out_nulled<dp_tensor>("dp_tensor_from_blob", [&](dp_tensor** out) {
    return dp_tensor_from_blob(out, data, DP_FLOAT32, 1, shape, kNoDevice, nullptr, nullptr);
  });
  expect_out_nulled<dp_tensor>("dp_tensor_to_device", [](dp_tensor** out) {
    return dp_tensor_to_device(out, nullptr, dp_device{DP_DEVICE_CPU, 0});
  });
  expect_out_nulled<dp_tensor>("dp_tensor_from_dlpack",
                               [](dp_tensor** out) { return dp_tensor_from_dlpack(out, nullptr); });
  expect_out_nulled<DLManagedTensor>("dp_tensor_to_dlpack",
                                     [](DLManagedTensor** out) { return dp_tensor_to_dlpack(nullptr, out); });
  expect_out_nulled<dp_tensor>("dp_reduce_add", [](dp_tensor** out) {
    return dp_reduce_add(nullptr, 0, dp_device{DP_DEVICE_CPU, 0}, out);
  });
  expect_out_nulled<dp_tensor>("dp_gather", [](dp_tensor** out) {
    return dp_gather(nullptr, 0, 0, dp_device{DP_DEVICE_CPU, 0}, out);
  });
  expect_out_nulled<dp_module>("dp_module_get_module",
                               [](dp_module** out) { return dp_module_get_module(nullptr, "a", out); });
  expect_out_nulled<dp_tensor>("dp_module_get_parameter",
                               [](dp_tensor** out) { return dp_module_get_parameter(nullptr, "a", out); });
  expect_out_nulled<dp_tensor>("dp_module_get_buffer",
                               [](dp_tensor** out) { return dp_module_get_buffer(nullptr, "a", out); });
  expect_out_nulled<dp_tensor>("dp_module_grad", [](dp_tensor** out) { return dp_module_grad(nullptr, "a", out); });
  expect_out_nulled<dp_tensor>("dp_module_parameter_at",
                               [](dp_tensor** out) { return dp_module_parameter_at(nullptr, 0, nullptr, out); });
  expect_out_nulled<dp_tensor>("dp_module_buffer_at",
                               [](dp_tensor** out) { return dp_module_buffer_at(nullptr, 0, nullptr, out); });
  expect_out_nulled<dp_replica_set>(
      "dp_replica_set_create", [](dp_replica_set** out) { return dp_replica_set_create(out, nullptr, nullptr, 0); });
  expect_out_nulled<dp_module>("dp_replica_set_replica",
                               [](dp_module** out) { return dp_replica_set_replica(nullptr, 0, out); });
  expect_out_nulled<dp_tensor>("dp_data_parallel", [](dp_tensor** out) {
    return dp_data_parallel(nullptr, nullptr, nullptr, 0, dp_device{DP_DEVICE_CPU, 0}, 0, forward_never_called, nullptr,
                            out);
  });
  expect_out_nulled<dp_tensor>("dp_replica_set_apply", [](dp_tensor** out) {
    return dp_replica_set_apply(nullptr, nullptr, 0, dp_device{DP_DEVICE_CPU, 0}, forward_never_called, nullptr, out);
  });
  expect_out_nulled<dp_store>("dp_store_create_file",
                              [](dp_store** out) { return dp_store_create_file(out, nullptr, 1); });
  expect_out_nulled<dp_store>("dp_store_create_tcp",
                              [](dp_store** out) { return dp_store_create_tcp(out, nullptr, 0, 1, 1, 1000); });
  expect_out_nulled<dp_process_group>("dp_process_group_create",
                                      [](dp_process_group** out) { return dp_process_group_create(out, nullptr); });
  expect_out_nulled<dp_process_group>("dp_process_group_split", [](dp_process_group** out) {
    return dp_process_group_split(nullptr, 0, 0, nullptr, out);
  });
  expect_out_nulled<dp_device_mesh>("dp_device_mesh_create", [](dp_device_mesh** out) {
    const int32_t extents[] = {1};
    return dp_device_mesh_create(out, nullptr, extents, 1, nullptr);
  });
  expect_out_nulled<dp_device_mesh>("dp_device_mesh_create_by_host",
                                    [](dp_device_mesh** out) { return dp_device_mesh_create_by_host(out, nullptr); });
  expect_out_nulled<dp_process_group>(
      "dp_device_mesh_group", [](dp_process_group** out) { return dp_device_mesh_group(nullptr, "dim0", out); });
  expect_out_nulled<const char>("dp_device_mesh_dim_name",
                                [](const char** out) { return dp_device_mesh_dim_name(nullptr, 0, out); });
  expect_out_nulled<dp_tensor>("dp_fsdp_shard", [](dp_tensor** out) { return dp_fsdp_shard(nullptr, 0, out); });
  expect_out_nulled<dp_tensor>("dp_fsdp_shard_grad",
                               [](dp_tensor** out) { return dp_fsdp_shard_grad(nullptr, 0, out); });
  expect_out_nulled<const char>("dp_fsdp_parameter_name",
                                [](const char** out) { return dp_fsdp_parameter_name(nullptr, 0, out); });
  expect_out_nulled<dp_module>("dp_fsdp_full_state_dict",
                               [](dp_module** out) { return dp_fsdp_full_state_dict(nullptr, nullptr, 0, out); });
  expect_out_nulled<dp_work>("dp_fsdp_save_sharded_state_dict_async", [](dp_work** out) {
    return dp_fsdp_save_sharded_state_dict_async(nullptr, nullptr, "folder", out);
  });
  expect_out_nulled<dp_tensor>("dp_tensor_from_dlpack_versioned",
                               [](dp_tensor** out) { return dp_tensor_from_dlpack_versioned(out, nullptr); });
  expect_out_nulled<DLManagedTensorVersioned>("dp_tensor_to_dlpack_versioned", [](DLManagedTensorVersioned** out) {
    return dp_tensor_to_dlpack_versioned(nullptr, 0, out);
  });
  expect_out_nulled<void>("dp_stream_create", [](void** out) { return dp_stream_create(kNoDevice, out); });
  expect_out_nulled<void>("dp_get_current_stream", [](void** out) { return dp_get_current_stream(kNoDevice, out); });
}

// A value out-parameter is written only on success: a failed call leaves
// what the caller had there.
TEST(CapiEntryPoints, AFailedCallLeavesItsValueOutAsItWas) {
  int used = 7;
  EXPECT_EQ(dp_ddp_parameter_used(nullptr, 0, &used), DP_EINVAL);
  EXPECT_EQ(used, 7) << "dp_ddp_parameter_used wrote its output and failed";
  int64_t added = 7;
  EXPECT_EQ(dp_store_add(nullptr, "k", 1, &added), DP_EINVAL);
  EXPECT_EQ(added, 7);
  int done = 7;
  EXPECT_EQ(dp_work_test(nullptr, &done), DP_EINVAL);
  EXPECT_EQ(done, 7);
  uint16_t port = 7;
  EXPECT_EQ(dp_store_tcp_port(nullptr, &port), DP_EINVAL);
  EXPECT_EQ(port, 7);
  size_t count = 7;
  EXPECT_EQ(dp_ddp_bucket_parameters(nullptr, 0, nullptr, 0, &count), DP_EINVAL);
  EXPECT_EQ(count, 7u);
  int32_t coordinate[1] = {7};
  EXPECT_EQ(dp_device_mesh_coordinate(nullptr, coordinate, 1), DP_EINVAL);
  EXPECT_EQ(coordinate[0], 7);
  EXPECT_EQ(dp_device_mesh_shape(nullptr, coordinate, 1), DP_EINVAL);
  EXPECT_EQ(coordinate[0], 7);
  dp_device device{7, 7};
  EXPECT_EQ(dp_device_parse("no such device", &device), DP_EINVAL);
  EXPECT_EQ(device.type, 7);
  EXPECT_EQ(device.index, 7);
}
