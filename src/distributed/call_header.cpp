#include "distributed/call_header.h"

#include <cstring>

#include "core/error.h"

namespace dparallel::dist {

const char* call_kind_name(uint32_t kind) {
  for (const CallKindInfo& info : kCallKinds) {
    if (static_cast<uint32_t>(info.kind) == kind) return info.name;
  }
  return "unknown collective";
}

CallHeader make_call_header(CallKind kind, int32_t rank, uint64_t seq, DType dtype, int64_t numel, ReduceOp op,
                            int32_t root) {
  CallHeader h{};
  h.magic = kCallHeaderMagic;
  h.kind = static_cast<uint32_t>(kind);
  h.dtype = static_cast<int32_t>(dtype);
  h.op = static_cast<int32_t>(op);
  h.root = root;
  h.rank = rank;
  h.numel = numel;
  h.seq = seq;
  h.tag = current_call_tag();
  return h;
}

CallHeader refused_call_header(CallKind kind, int32_t rank, uint64_t seq, const std::string& reason) {
  CallHeader h = make_call_header(kind, rank, seq, DType::kUInt8, 0);
  h.refused = 1;
  std::string text = reason;
  if (text.size() >= kRefusalReasonBytes) text = text.substr(0, kRefusalReasonBytes - 4) + "...";
  std::memcpy(h.reason, text.data(), text.size());
  return h;
}

namespace {
thread_local CallTag t_call_tag;
}  // namespace

CallTag current_call_tag() noexcept { return t_call_tag; }

CallTagScope::CallTagScope(const CallTag& tag) noexcept : saved_(t_call_tag) { t_call_tag = tag; }
CallTagScope::~CallTagScope() { t_call_tag = saved_; }

std::string call_item_name(CallItem item, uint32_t index) {
  switch (item) {
    case CallItem::kBucket:
      return str_cat("bucket ", index, "'s reduction");
    case CallItem::kUsedMap:
      return "the used parameters' all_reduce";
    case CallItem::kReadyOrder:
      return "the ready order's broadcast";
    case CallItem::kBuffers:
      return "the buffers' broadcast";
    case CallItem::kCreate:
      return "dp_ddp_create's agreement check and broadcast";
    case CallItem::kJoinSync:
      return "dp_ddp_join's broadcast of the last rank's state";
    case CallItem::kFsdpCreate:
      return "dp_fsdp_create's agreement check and broadcast";
    // The call kind says how (an all_gather, or a barrier when the full
    // parameters are views of the shards).
    case CallItem::kUnshard:
      return "the unshard";
    case CallItem::kPostBackward:
      return "the post-backward reduce_scatter";
    case CallItem::kGatherValues:
      return "the full parameters' gather";
    case CallItem::kStateDict:
      return "a state dict's agreement";
    case CallItem::kReplicaReduce:
      return "the post-backward all_reduce across the replicas";
    case CallItem::kNone:
      break;
  }
  return str_cat("item ", static_cast<uint32_t>(item), ".", index);
}

std::string describe_call_tag(const CallTag& tag) {
  if (tag.owner == 0) return "the host's own call";
  if (tag.owner == kLaneRoundOwner) return str_cat("the DDP lane's agreement round #", tag.job);
  const auto item = static_cast<CallItem>(tag.item >> 24);
  return str_cat(is_sharding_item(item) ? "dp_fsdp #" : "dp_ddp #", tag.owner - 1, "'s job #", tag.job, " (",
                 call_item_name(item, tag.item & 0xffffffu), ", iteration ", tag.iteration, ")");
}

namespace detail {

void fail_malformed(const CallHeader& mine, int32_t r) {
  fail(StatusCode::kRemote, call_kind_name(mine.kind), ": rank ", r, " sent a malformed header");
}

void fail_out_of_step(const CallHeader& mine, int32_t rank, const CallHeader& theirs, int32_t r) {
  // Who made each call, where that differs (the same caller is no news).
  std::string callers = mine.tag == theirs.tag ? std::string()
                                               : str_cat("; rank ", rank, "'s call is ", describe_call_tag(mine.tag),
                                                         ", rank ", r, "'s is ", describe_call_tag(theirs.tag));
  fail(StatusCode::kRemote, call_kind_name(mine.kind), " (collective #", mine.seq, " of rank ", rank, "): rank ", r,
       " called ", call_kind_name(theirs.kind), " as its collective #", theirs.seq, callers,
       "; every rank must issue the same collectives in the same order");
}

void add_refusal(std::string& refusals, const CallHeader& h, int32_t r) {
  // The reason came over the wire: read it only up to its buffer's end.
  std::string reason(h.reason, ::strnlen(h.reason, kRefusalReasonBytes));
  refusals += str_cat(refusals.empty() ? "" : "; ", "rank ", r, " refused the call: ", reason);
}

void fail_refused(const CallHeader& mine, const std::string& refusals) {
  fail_invalid(call_kind_name(mine.kind), " (collective #", mine.seq, "): ", refusals,
               " (every rank's call failed; the group stays usable)");
}

void fail_differ(const CallHeader& mine, int32_t rank, const CallHeader& theirs, int32_t r) {
  auto op = [](const CallHeader& h) { return reduce_op_name(static_cast<ReduceOp>(h.op)); };
  auto dtype = [](const CallHeader& h) { return dtype_name(static_cast<DType>(h.dtype)); };
  fail_invalid(call_kind_name(mine.kind), ": arguments differ across ranks: rank ", rank, " has ", mine.numel,
               " elements of ", dtype(mine), " (op ", op(mine), ", root ", mine.root, "), rank ", r, " has ",
               theirs.numel, " elements of ", dtype(theirs), " (op ", op(theirs), ", root ", theirs.root, ")");
}

}  // namespace detail

}  // namespace dparallel::dist
