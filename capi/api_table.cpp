// dp_api.h: the function table for dlopen hosts, expanded from DP_API_SLOTS.
#include <cstddef>
#include <type_traits>

#include "dparallel/dp_api.h"

namespace {

// Each slot has exactly the type of the function it holds.
#define DP_CHECK_SLOT_TYPE(ret, name, params)                                      \
  static_assert(std::is_same<decltype(dp_api::name), decltype(&dp_##name)>::value, \
                "dp_api::" #name " differs from dp_" #name "'s type");
DP_API_SLOTS(DP_CHECK_SLOT_TYPE)
#undef DP_CHECK_SLOT_TYPE

// The slots' indices, in the list's order.
enum SlotIndex : size_t {
#define DP_SLOT_INDEX(ret, name, params) kSlot_##name,
  DP_API_SLOTS(DP_SLOT_INDEX)
#undef DP_SLOT_INDEX
      kSlotCount
};

// Frozen offsets: moving a field breaks every host built against the table.
// Every slot is pointer-sized and unpadded; the anchors below pin where each
// group starts, so an insertion or removal in the list fails here (a swap of
// two slots fails tests/abi's slot-order test).
constexpr size_t kFirstSlot = 16;
constexpr size_t slot(size_t index) { return kFirstSlot + index * sizeof(void*); }
#define DP_CHECK_SLOT_OFFSET(ret, name, params) \
  static_assert(offsetof(dp_api, name) == slot(kSlot_##name), "dp_api::" #name " is not at its index");
DP_API_SLOTS(DP_CHECK_SLOT_OFFSET)
#undef DP_CHECK_SLOT_OFFSET
static_assert(offsetof(dp_api, status_string) == slot(0), "dp_api layout changed");
static_assert(offsetof(dp_api, tensor_create) == slot(7), "dp_api layout changed");
static_assert(offsetof(dp_api, broadcast) == slot(21), "dp_api layout changed");
static_assert(offsetof(dp_api, module_create) == slot(27), "dp_api layout changed");
static_assert(offsetof(dp_api, replicate) == slot(43), "dp_api layout changed");
static_assert(offsetof(dp_api, parallel_apply) == slot(50), "dp_api layout changed");
static_assert(offsetof(dp_api, store_create_file) == slot(53), "dp_api layout changed");
static_assert(offsetof(dp_api, tensor_to_device) == slot(75), "dp_api layout changed");
static_assert(offsetof(dp_api, process_group_backend) == slot(85), "dp_api layout changed");
static_assert(offsetof(dp_api, ddp_options_init) == slot(86), "dp_api layout changed");
static_assert(offsetof(dp_api, fsdp_options_init) == slot(108), "dp_api layout changed");
static_assert(offsetof(dp_api, shutdown) == slot(127), "dp_api layout changed");
static_assert(offsetof(dp_api, process_group_split) == slot(128), "dp_api layout changed");
static_assert(offsetof(dp_api, fsdp_mark_grad_ready) == slot(140), "dp_api layout changed");
static_assert(offsetof(dp_api, process_group_abort) == slot(145), "dp_api layout changed");
static_assert(offsetof(dp_api, process_group_shrink) == slot(146), "dp_api layout changed");
static_assert(offsetof(dp_api, fsdp_save_sharded_state_dict_async) == slot(148), "dp_api layout changed");
static_assert(offsetof(dp_api, ddp_rebind) == slot(149), "dp_api layout changed");
static_assert(kSlotCount == 150, "dp_api layout changed");
static_assert(sizeof(dp_api) == slot(kSlotCount), "dp_api layout changed");

#define DP_SLOT_VALUE(ret, name, params) dp_##name,
const dp_api kApi = {sizeof(dp_api), DP_VERSION_MAJOR, DP_API_MINOR, DP_API_SLOTS(DP_SLOT_VALUE)};
#undef DP_SLOT_VALUE

}  // namespace

extern "C" const dp_api* dp_get_api(uint32_t abi_major) { return abi_major == DP_VERSION_MAJOR ? &kApi : nullptr; }
