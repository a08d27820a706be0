// What every rank of a process group sends the others before each
// collective, whatever the backend, and the one verdict all ranks reach on
// what they received. Every rank sees the same headers and applies the same
// checks in the same order, so all of them fail alike or none does.
#pragma once

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "distributed/collective.h"

namespace dparallel::dist {

constexpr uint32_t kCallHeaderMagic = 0x64704733;  // "dpG3"
constexpr size_t kRefusalReasonBytes = 448;

// What a call in a component's own sequence is (CallTag::item's high byte).
enum class CallItem : uint32_t {
  kNone = 0,
  kBucket = 1,      // a bucket's reduction (the low 24 bits: its index)
  kUsedMap = 2,     // which parameters any rank used
  kReadyOrder = 3,  // rank 0's ready order, for the rebuilt buckets
  kBuffers = 4,     // the buffers' broadcast before a forward
  kCreate = 5,      // the agreement check and broadcast at creation
  kJoinSync = 6,    // dp_ddp_join's end: the last rank to join broadcasts its state
  // dp_fsdp's (items from kFsdpCreate on are a sharding's).
  kFsdpCreate = 7,      // the agreement check and broadcast at creation
  kUnshard = 8,         // the parameters' all_gather (a barrier with views)
  kPostBackward = 9,    // the gradients' reduce_scatter
  kGatherValues = 10,   // the full values, for a state dict or dp_fsdp_destroy
  kStateDict = 11,      // a state dict save's or load's agreement (the save's id, every rank's outcome)
  kReplicaReduce = 12,  // HSDP: the shard gradients' all_reduce across the replicas
};
inline bool is_sharding_item(CallItem item) { return item >= CallItem::kFsdpCreate; }

// Who issued a call and which of its calls it is. The ranks pair calls by
// their order on the group; the tag makes a pairing of two different
// calls an error naming both, never a silent exchange of their bytes.
struct CallTag {
  uint32_t owner = 0;  // 0: the host's own call; kLaneRoundOwner; else 1 + a dp_ddp's number on the group
  uint32_t job = 0;    // the owner's job number (a lane round: the round's number)
  uint32_t iteration = 0;
  uint32_t item = 0;  // CallItem << 24 | index
  bool operator==(const CallTag& o) const {
    return owner == o.owner && job == o.job && iteration == o.iteration && item == o.item;
  }
  bool operator!=(const CallTag& o) const { return !(*this == o); }
};
// The DDP lane's rounds, in which the ranks agree on which jobs run next.
constexpr uint32_t kLaneRoundOwner = 0xffffffffu;

// What a call of `item` is, for messages ("the ready order's broadcast");
// a bucket's: "bucket <index>'s reduction".
std::string call_item_name(CallItem item, uint32_t index);
std::string describe_call_tag(const CallTag& tag);
// The tag the calls made on this thread carry (the host's: all zero).
CallTag current_call_tag() noexcept;
// Tags this thread's calls while it lives.
class CallTagScope {
 public:
  explicit CallTagScope(const CallTag& tag) noexcept;
  ~CallTagScope();
  CallTagScope(const CallTagScope&) = delete;
  CallTagScope& operator=(const CallTagScope&) = delete;

 private:
  CallTag saved_;
};

struct CallHeader {
  uint32_t magic;
  uint32_t kind;  // CallKind
  int32_t dtype;
  int32_t op;
  int32_t root;
  int32_t rank;
  int64_t numel;
  uint64_t seq;
  // Nonzero: this rank refused its call (an argument error found on it) and
  // takes part only so that the others fail now and stay in step.
  uint32_t refused;
  CallTag tag;
  uint8_t reserved[4];
  char reason[kRefusalReasonBytes];  // why it refused; NUL-terminated
};
static_assert(sizeof(CallHeader) == 512, "the header is part of the wire format");

const char* call_kind_name(uint32_t kind);

CallHeader make_call_header(CallKind kind, int32_t rank, uint64_t seq, DType dtype, int64_t numel,
                            ReduceOp op = ReduceOp::kSum, int32_t root = -1);
// The header of a call this rank refused; `reason` is cut to fit.
CallHeader refused_call_header(CallKind kind, int32_t rank, uint64_t seq, const std::string& reason);

// Throws unless every rank's header matches `mine`: kRemote for a malformed
// header or a rank out of step (another collective, sequence number or
// tag; a refused call may stand in for any collective; the group breaks), else kInvalidArgument for refusals (naming
// each refusing rank and its reason), then for sizes, dtypes, ops or roots that differ. `header_of(r)` returns rank r's
// header.
template <typename HeaderOf>
void check_call_headers(const CallHeader& mine, int32_t rank, int32_t size, HeaderOf&& header_of);

namespace detail {
[[noreturn]] void fail_malformed(const CallHeader& mine, int32_t r);
[[noreturn]] void fail_out_of_step(const CallHeader& mine, int32_t rank, const CallHeader& theirs, int32_t r);
[[noreturn]] void fail_refused(const CallHeader& mine, const std::string& refusals);
[[noreturn]] void fail_differ(const CallHeader& mine, int32_t rank, const CallHeader& theirs, int32_t r);
void add_refusal(std::string& refusals, const CallHeader& h, int32_t r);
}  // namespace detail

template <typename HeaderOf>
void check_call_headers(const CallHeader& mine, int32_t rank, int32_t size, HeaderOf&& header_of) {
  for (int32_t r = 0; r < size; ++r) {
    const CallHeader h = header_of(r);
    if (h.magic != kCallHeaderMagic || h.rank != r) detail::fail_malformed(mine, r);
    bool same_kind = h.kind == mine.kind || h.refused != 0 || mine.refused != 0;
    if (!same_kind || h.seq != mine.seq || h.tag != mine.tag) detail::fail_out_of_step(mine, rank, h, r);
  }
  std::string refusals;
  for (int32_t r = 0; r < size; ++r) {
    const CallHeader h = header_of(r);
    if (h.refused != 0) detail::add_refusal(refusals, h, r);
  }
  if (!refusals.empty()) detail::fail_refused(mine, refusals);
  for (int32_t r = 0; r < size; ++r) {
    const CallHeader h = header_of(r);
    if (h.numel != mine.numel || h.dtype != mine.dtype || h.op != mine.op || h.root != mine.root) {
      detail::fail_differ(mine, rank, h, r);
    }
  }
}

}  // namespace dparallel::dist
