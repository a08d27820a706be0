#include <algorithm>

#include "comm/comm.h"
#include "core/error.h"
#include "device/cpu/cpu_kernels.h"
#include "device/cuda/cuda_runtime.h"

namespace dparallel::comm {

namespace {

bool all_cpu(const std::vector<Device>& devices) {
  return std::all_of(devices.begin(), devices.end(), [](const Device& d) { return d.is_cpu(); });
}

// NCCL applies when the source and every destination are distinct GPUs of this process.
bool nccl_applies(const Device& source, const std::vector<Device>& devices) {
  if (!cuda::nccl_compiled() || devices.size() < 2 || !source.is_cuda()) return false;
  bool has_source = false;
  std::vector<Device> sorted = devices;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) {
    if (!sorted[i].is_cuda() || (i > 0 && sorted[i] == sorted[i - 1])) return false;
    has_source = has_source || sorted[i] == source;
  }
  return has_source;
}

std::vector<int32_t> indices_of(const std::vector<Device>& devices) {
  std::vector<int32_t> indices;
  indices.reserve(devices.size());
  for (const Device& d : devices) indices.push_back(d.index);
  return indices;
}

// Copies `nbytes` at `src` (on `source`) to dsts[i] (on devices[i]); dsts[i] may equal src.
void copy_out(const void* src, const Device& source, const std::vector<void*>& dsts, const std::vector<Device>& devices,
              size_t nbytes) {
  if (nbytes == 0) return;
  if (source.is_cpu() && all_cpu(devices)) {
    std::vector<void*> targets;
    for (void* d : dsts) {
      if (d != src) targets.push_back(d);
    }
    if (!targets.empty()) cpu::copy_to_many(targets.data(), targets.size(), src, nbytes);
    return;
  }
  if (nccl_applies(source, devices)) {
    size_t root = static_cast<size_t>(std::find(devices.begin(), devices.end(), source) - devices.begin());
    std::vector<void*> buffers = dsts;
    buffers[root] = const_cast<void*>(src);  // NCCL reads the root's buffer, never writes it
    cuda::nccl_broadcast(indices_of(devices), buffers, root, nbytes);
    // NCCL wrote every GPU but the source's: an output there that is not the source gets a local copy.
    copy_bytes(dsts[root], source, src, source, nbytes);
    return;
  }
  for (size_t i = 0; i < dsts.size(); ++i) {
    if (dsts[i] != src) copy_bytes(dsts[i], devices[i], src, source, nbytes);
  }
}

}  // namespace

std::vector<Tensor> broadcast(const Tensor& tensor, const std::vector<Device>& devices) {
  if (devices.empty()) fail_invalid("argument 'devices' is empty: broadcast needs at least one device");
  std::vector<Tensor> out;
  std::vector<void*> dsts;
  out.reserve(devices.size());
  for (const Device& device : devices) {
    out.push_back(device == tensor.device() ? tensor : Tensor::empty(tensor.dtype(), tensor.shape(), device));
    dsts.push_back(out.back().data());
  }
  copy_out(tensor.data(), tensor.device(), dsts, devices, tensor.nbytes());
  return out;
}

std::vector<std::vector<Tensor>> broadcast_coalesced(const std::vector<Tensor>& tensors,
                                                     const std::vector<Device>& devices, size_t buffer_size) {
  if (devices.empty()) fail_invalid("argument 'devices' is empty: broadcast_coalesced needs at least one device");
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].device() != devices[0]) {
      fail_invalid("all tensors must be on devices[0] (", to_string(devices[0]), "), but tensors[", i, "] is on ",
                   to_string(tensors[i].device()));
    }
  }
  if (buffer_size == 0) buffer_size = kDefaultBufferSize;
  std::vector<std::vector<Tensor>> out(devices.size(), std::vector<Tensor>(tensors.size()));
  out[0] = tensors;
  const Device& source = devices[0];
  for (const std::vector<size_t>& chunk : take_tensors(tensors, buffer_size)) {
    size_t chunk_bytes = 0;
    for (size_t t : chunk) chunk_bytes += tensors[t].nbytes();
    DType dtype = tensors[chunk.front()].dtype();
    // One flat buffer per destination; the outputs are views into it, as torch's unflatten gives.
    std::vector<Tensor> flats(devices.size());
    for (size_t d = 1; d < devices.size(); ++d) {
      flats[d] = Tensor::empty(DType::kUInt8, {static_cast<int64_t>(chunk_bytes)}, devices[d]);
      size_t offset = 0;
      for (size_t t : chunk) {
        out[d][t] = flats[d].view_at(offset, dtype, tensors[t].shape());
        offset += tensors[t].nbytes();
      }
    }
    if (devices.size() == 1 || chunk_bytes == 0) continue;
    if (nccl_applies(source, devices) && chunk.size() > 1) {
      // Flatten on the source GPU once, then one NCCL broadcast for the chunk.
      Tensor staging = Tensor::empty(DType::kUInt8, {static_cast<int64_t>(chunk_bytes)}, source);
      std::vector<cuda::Segment> segments;
      size_t offset = 0;
      for (size_t t : chunk) {
        segments.push_back({static_cast<char*>(staging.data()) + offset, tensors[t].data(), tensors[t].nbytes()});
        offset += tensors[t].nbytes();
      }
      cuda::batched_copy(source.index, segments);
      std::vector<void*> dsts{staging.data()};
      for (size_t d = 1; d < devices.size(); ++d) dsts.push_back(flats[d].data());
      copy_out(staging.data(), source, dsts, devices, chunk_bytes);
      continue;
    }
    // Each tensor straight into its place in every destination's flat buffer.
    for (size_t t : chunk) {
      std::vector<void*> dsts{const_cast<void*>(tensors[t].data())};
      for (size_t d = 1; d < devices.size(); ++d) dsts.push_back(out[d][t].data());
      copy_out(tensors[t].data(), source, dsts, devices, tensors[t].nbytes());
    }
  }
  return out;
}

void broadcast_into(const Tensor& tensor, const std::vector<Tensor>& outputs) {
  std::vector<void*> dsts;
  std::vector<Device> devices;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].shape() != tensor.shape() || outputs[i].dtype() != tensor.dtype()) {
      fail_invalid("output ", i, " is ", outputs[i].describe(), " but the source is ", tensor.describe());
    }
    dsts.push_back(outputs[i].data());
    devices.push_back(outputs[i].device());
  }
  if (!dsts.empty()) copy_out(tensor.data(), tensor.device(), dsts, devices, tensor.nbytes());
}

}  // namespace dparallel::comm
