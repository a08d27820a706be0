// dp_api.h: the function table for dlopen hosts.
#include <cstddef>

#include "dparallel/dp_api.h"

namespace {

// Frozen offsets: moving a field breaks every host built against the table.
static_assert(offsetof(dp_api, status_string) == 16, "dp_api layout changed");
static_assert(offsetof(dp_api, tensor_create) == 16 + 7 * sizeof(void*), "dp_api layout changed");
static_assert(offsetof(dp_api, broadcast) == 16 + 21 * sizeof(void*), "dp_api layout changed");
static_assert(offsetof(dp_api, tensor_to_device) == 16 + 27 * sizeof(void*), "dp_api layout changed");

const dp_api kApi = {
    sizeof(dp_api),
    DP_VERSION_MAJOR,
    DP_API_MINOR,
    dp_status_string,
    dp_last_error,
    dp_version_number,
    dp_device_count,
    dp_device_parse,
    dp_device_format,
    dp_dtype_size,
    dp_tensor_create,
    dp_tensor_from_blob,
    dp_tensor_destroy,
    dp_tensor_copy_from_host,
    dp_tensor_copy_to_host,
    dp_tensor_dtype,
    dp_tensor_ndim,
    dp_tensor_shape,
    dp_tensor_numel,
    dp_tensor_nbytes,
    dp_tensor_device,
    dp_tensor_data,
    dp_tensor_from_dlpack,
    dp_tensor_to_dlpack,
    dp_broadcast,
    dp_broadcast_coalesced,
    dp_reduce_add,
    dp_reduce_add_coalesced,
    dp_scatter,
    dp_gather,
    dp_tensor_to_device,
};

}  // namespace

extern "C" const dp_api* dp_get_api(uint32_t abi_major) { return abi_major == DP_VERSION_MAJOR ? &kApi : nullptr; }
