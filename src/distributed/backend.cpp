#include "distributed/backend.h"

#include "comm/comm.h"
#include "core/error.h"

namespace dparallel::dist {

QueuedTransfers::QueuedTransfers(const Device& device, void* transfer_stream) {
  if (transfer_stream != nullptr) library_.emplace(device, transfer_stream);
}

bool QueuedTransfers::active() { return library_work_stays_queued(); }

void Backend::all_reduce_coalesced(const std::vector<Tensor>& tensors, ReduceOp op) {
  if (tensors.size() == 1) return all_reduce(tensors[0], op);
  int64_t numel = comm::total_numel(tensors);
  Tensor flat;
  try {
    flat = Tensor::empty(tensors[0].dtype(), {numel}, device());
  } catch (const Error& e) {
    if (e.code() != StatusCode::kOutOfMemory) throw;
    refuse_out_of_memory(CallKind::kAllReduce, "all_reduce_coalesced",
                         str_cat("out of memory for the ", numel, "-element scratch of a coalesced all_reduce"));
  }
  comm::flatten_into(flat, tensors);
  all_reduce(flat, op);
  comm::unflatten_into(tensors, flat);
}

void Backend::all_gather_runs(size_t segment, const std::vector<SegmentRun>& sources,
                              const std::vector<std::vector<SegmentRun>>& places) {
  const auto ranks = static_cast<size_t>(size());
  Tensor gathered;
  try {
    gathered = Tensor::zeros(DType::kUInt8, {static_cast<int64_t>(segment * ranks)}, device());
  } catch (const Error& e) {
    if (e.code() != StatusCode::kOutOfMemory) throw;
    refuse_out_of_memory(CallKind::kAllGather, "all_gather",
                         str_cat("out of memory for the ", segment * ranks, "-byte scratch of an all_gather"));
  }
  auto* base = static_cast<uint8_t*>(gathered.data());
  uint8_t* mine = base + static_cast<size_t>(rank()) * segment;
  for (const SegmentRun& run : sources) {
    dparallel::copy_bytes(mine + run.offset, device(), run.view.data(), run.view.device(), run.view.nbytes());
  }
  std::vector<Tensor> outputs;
  outputs.reserve(ranks);
  for (size_t q = 0; q < ranks; ++q) {
    outputs.push_back(gathered.view_at(q * segment, DType::kUInt8, {static_cast<int64_t>(segment)}));
  }
  all_gather(outputs[static_cast<size_t>(rank())], outputs);
  for (size_t q = 0; q < ranks; ++q) {
    for (const SegmentRun& run : places[q]) {
      dparallel::copy_bytes(run.view.data(), run.view.device(), base + q * segment + run.offset, device(),
                            run.view.nbytes());
    }
  }
}

void Backend::reduce_scatter_runs(const std::vector<std::vector<SegmentRun>>& parts, const Tensor& output, ReduceOp op,
                                  bool accumulate) {
  const auto ranks = static_cast<size_t>(size());
  const size_t part = output.nbytes();
  Tensor input;
  try {
    input = Tensor::zeros(output.dtype(), {output.numel() * size()}, device());
  } catch (const Error& e) {
    if (e.code() != StatusCode::kOutOfMemory) throw;
    refuse_out_of_memory(CallKind::kReduceScatter, "reduce_scatter",
                         str_cat("out of memory for the ", part * ranks, "-byte scratch of a reduce_scatter"));
  }
  auto* base = static_cast<uint8_t*>(input.data());
  std::vector<Tensor> inputs;
  inputs.reserve(ranks);
  for (size_t q = 0; q < ranks; ++q) {
    for (const SegmentRun& run : parts[q]) {
      dparallel::copy_bytes(base + q * part + run.offset, device(), run.view.data(), run.view.device(),
                            run.view.nbytes());
    }
    inputs.push_back(input.view_at(q * part, output.dtype(), {output.numel()}));
  }
  if (!accumulate) return reduce_scatter(inputs, output, op);
  Tensor result = Tensor::empty(output.dtype(), output.shape(), device());
  reduce_scatter(inputs, result, op);
  comm::reduce_add_into(output, {output, result});
}

std::string Backend::claim_key_prefix(const std::shared_ptr<Store>& store, const char* family) {
  std::string prefix = next_group_prefix(*store, family, rank());
  site_.set_failure_reports(store, prefix);
  return prefix;
}

std::string next_group_prefix(Store& store, const char* family, int32_t rank) {
  int64_t generation = store.add(str_cat("dp/", family, "_count/", rank), 1);
  return str_cat("dp/", family, generation, "/");
}

std::string describe_call(const Call& call) {
  if (call.tensor == nullptr) return call.header.refused != 0 ? "a refused call" : "no tensor";
  if (call.pieces > 1) {
    return str_cat(dtype_name(call.tensor->dtype()), " ", call.header.numel, " in ", call.pieces, " tensors");
  }
  return call.tensor->describe();
}

}  // namespace dparallel::dist
