// dp_comm.h: in-process collectives.
#include "comm/comm.h"

#include <cstdint>

#include "capi/capi_internal.h"
#include "dparallel/dp_comm.h"

using namespace dparallel;

namespace {

void require_out(dp_tensor** out, size_t count, const char* name) {
  if (out == nullptr) fail_invalid("argument '", name, "' is NULL but ", count, " outputs are due");
  for (size_t i = 0; i < count; ++i) out[i] = nullptr;
}

}  // namespace

extern "C" {

dp_status dp_broadcast(const dp_tensor* tensor, const dp_device* devices, size_t ndevices, dp_tensor** out) {
  DP_API_BEGIN
  require_out(out, ndevices, "out");
  const Tensor& source = capi::tensor_arg(tensor, "tensor");
  if (ndevices == 0) fail_invalid("argument 'ndevices' is 0: broadcast needs at least one device");
  std::vector<Device> targets = capi::devices_arg(devices, ndevices, "devices");
  std::vector<Tensor> copies =
      capi::in_stream_order(capi::devices_of({source}, targets), [&] { return comm::broadcast(source, targets); });
  capi::export_tensors(copies, out);
  DP_API_END
}

dp_status dp_broadcast_coalesced(const dp_tensor* const* tensors, size_t ntensors, const dp_device* devices,
                                 size_t ndevices, size_t buffer_size, dp_tensor** out) {
  DP_API_BEGIN
  if (ndevices == 0) fail_invalid("argument 'ndevices' is 0: broadcast_coalesced needs at least one device");
  if (ntensors > 0 && ndevices > SIZE_MAX / ntensors) fail_invalid("ndevices * ntensors overflows");
  require_out(out, ndevices * ntensors, "out");
  std::vector<Tensor> inputs = capi::tensors_arg(tensors, ntensors, "tensors");
  std::vector<Device> targets = capi::devices_arg(devices, ndevices, "devices");
  std::vector<std::vector<Tensor>> copies = capi::in_stream_order(
      capi::devices_of(inputs, targets), [&] { return comm::broadcast_coalesced(inputs, targets, buffer_size); });
  std::vector<Tensor> flat;
  for (auto& per_device : copies) {
    for (auto& t : per_device) flat.push_back(std::move(t));
  }
  capi::export_tensors(flat, out);
  DP_API_END
}

dp_status dp_reduce_add(const dp_tensor* const* inputs, size_t ninputs, dp_device destination, dp_tensor** out) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  if (ninputs == 0) fail_invalid("argument 'ninputs' is 0: reduce_add needs at least one input");
  std::vector<Tensor> tensors = capi::tensors_arg(inputs, ninputs, "inputs");
  Device dest = capi::device_arg(destination, "destination");
  Tensor sum =
      capi::in_stream_order(capi::devices_of(tensors, {dest}), [&] { return comm::reduce_add(tensors, dest); });
  *out = capi::new_tensor_handle(sum);
  DP_API_END
}

dp_status dp_reduce_add_coalesced(const dp_tensor* const* inputs, size_t ndevices, size_t ntensors,
                                  dp_device destination, size_t buffer_size, dp_tensor** out) {
  DP_API_BEGIN
  require_out(out, ntensors, "out");
  if (ndevices == 0) fail_invalid("argument 'ndevices' is 0: reduce_add_coalesced needs at least one device's list");
  if (ntensors > 0 && ndevices > SIZE_MAX / ntensors) fail_invalid("ndevices * ntensors overflows");
  std::vector<Tensor> all = capi::tensors_arg(inputs, ndevices * ntensors, "inputs");
  Device dest = capi::device_arg(destination, "destination");
  std::vector<std::vector<Tensor>> lists(ndevices);
  for (size_t d = 0; d < ndevices; ++d) {
    lists[d].assign(all.begin() + static_cast<std::ptrdiff_t>(d * ntensors),
                    all.begin() + static_cast<std::ptrdiff_t>((d + 1) * ntensors));
  }
  std::vector<Tensor> sums = capi::in_stream_order(
      capi::devices_of(all, {dest}), [&] { return comm::reduce_add_coalesced(lists, dest, buffer_size); });
  capi::export_tensors(sums, out);
  DP_API_END
}

dp_status dp_scatter(const dp_tensor* tensor, const dp_device* devices, size_t ndevices, const int64_t* chunk_sizes,
                     int32_t dim, dp_tensor** out, size_t* out_count) {
  DP_API_BEGIN
  require_out(out, ndevices, "out");
  capi::require_arg(out_count, "out_count");
  const Tensor& source = capi::tensor_arg(tensor, "tensor");
  if (ndevices == 0) fail_invalid("argument 'ndevices' is 0: scatter needs at least one device");
  std::vector<Device> targets = capi::devices_arg(devices, ndevices, "devices");
  std::vector<int64_t> sizes;
  if (chunk_sizes != nullptr) sizes.assign(chunk_sizes, chunk_sizes + ndevices);
  std::vector<Tensor> chunks = capi::in_stream_order(capi::devices_of({source}, targets),
                                                     [&] { return comm::scatter(source, targets, sizes, dim); });
  capi::export_tensors(chunks, out);
  *out_count = chunks.size();
  DP_API_END
}

dp_status dp_gather(const dp_tensor* const* tensors, size_t ntensors, int32_t dim, dp_device destination,
                    dp_tensor** out) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  if (ntensors == 0) fail_invalid("argument 'ntensors' is 0: gather needs at least one tensor");
  std::vector<Tensor> inputs = capi::tensors_arg(tensors, ntensors, "tensors");
  Device dest = capi::device_arg(destination, "destination");
  Tensor gathered =
      capi::in_stream_order(capi::devices_of(inputs, {dest}), [&] { return comm::gather(inputs, dim, dest); });
  *out = capi::new_tensor_handle(gathered);
  DP_API_END
}

}  // extern "C"
