#include "distributed/backend.h"

#include "comm/comm.h"
#include "core/error.h"

namespace dparallel::dist {

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
