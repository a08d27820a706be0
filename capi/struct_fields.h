// The fields of each public struct that carries struct_size, as this
// library knows them. A caller's struct_size comes from its header, older
// or newer: an older one ends after some field (and its padding), a newer
// one reaches past all of them. A size that ends inside a field is no
// header's, and copying that prefix would take half a value (half a
// pointer), so it is refused.
#pragma once

#include <cstddef>

#include "dparallel/dp_base.h"
#include "dparallel/dp_ddp.h"
#include "dparallel/dp_dist.h"
#include "dparallel/dp_fsdp.h"

namespace dparallel::capi {

struct FieldSpan {
  const char* name;
  size_t begin;
  size_t end;
};

// The size of a member, from its pointer-to-member type (a pointer field's
// size is what is wanted, which sizeof on the field reads as a mistake).
template <typename Struct, typename Field>
constexpr size_t member_size(Field Struct::*) {
  return sizeof(Field);  // NOLINT(bugprone-sizeof-expression): a pointer field's own size
}

#define DP_FIELD_SPAN(type, field) \
  FieldSpan { #field, offsetof(type, field), offsetof(type, field) + member_size(&type::field) }

template <typename Struct>
struct KnownFields;

template <>
struct KnownFields<dp_process_group_options> {
  static constexpr const char* kName = "dp_process_group_options";
  static constexpr FieldSpan kFields[] = {
      DP_FIELD_SPAN(dp_process_group_options, struct_size), DP_FIELD_SPAN(dp_process_group_options, backend),
      DP_FIELD_SPAN(dp_process_group_options, rank),        DP_FIELD_SPAN(dp_process_group_options, world_size),
      DP_FIELD_SPAN(dp_process_group_options, store),       DP_FIELD_SPAN(dp_process_group_options, timeout_ms),
      DP_FIELD_SPAN(dp_process_group_options, device),
  };
};

template <>
struct KnownFields<dp_ddp_options> {
  static constexpr const char* kName = "dp_ddp_options";
  static constexpr FieldSpan kFields[] = {
      DP_FIELD_SPAN(dp_ddp_options, struct_size),
      DP_FIELD_SPAN(dp_ddp_options, bucket_cap_mb),
      DP_FIELD_SPAN(dp_ddp_options, first_bucket_cap_mb),
      DP_FIELD_SPAN(dp_ddp_options, gradient_as_bucket_view),
      DP_FIELD_SPAN(dp_ddp_options, broadcast_buffers),
      DP_FIELD_SPAN(dp_ddp_options, find_unused_parameters),
      DP_FIELD_SPAN(dp_ddp_options, init_sync),
      DP_FIELD_SPAN(dp_ddp_options, ignored_modules),
      DP_FIELD_SPAN(dp_ddp_options, num_ignored_modules),
      DP_FIELD_SPAN(dp_ddp_options, ignored_parameters),
      DP_FIELD_SPAN(dp_ddp_options, num_ignored_parameters),
      DP_FIELD_SPAN(dp_ddp_options, comm_hook),
      DP_FIELD_SPAN(dp_ddp_options, hook_fn),
      DP_FIELD_SPAN(dp_ddp_options, hook_user_data),
      // abi_minor 6
      DP_FIELD_SPAN(dp_ddp_options, static_graph),
      DP_FIELD_SPAN(dp_ddp_options, join_divide_by_initial_world_size),
      DP_FIELD_SPAN(dp_ddp_options, on_bucket_reduced),
      DP_FIELD_SPAN(dp_ddp_options, on_bucket_reduced_data),
      DP_FIELD_SPAN(dp_ddp_options, bucket_plan),
  };
};

template <>
struct KnownFields<dp_fsdp_options> {
  static constexpr const char* kName = "dp_fsdp_options";
  static constexpr FieldSpan kFields[] = {
      DP_FIELD_SPAN(dp_fsdp_options, struct_size), DP_FIELD_SPAN(dp_fsdp_options, reshard_after_forward),
      DP_FIELD_SPAN(dp_fsdp_options, param_dtype), DP_FIELD_SPAN(dp_fsdp_options, reduce_dtype),
      DP_FIELD_SPAN(dp_fsdp_options, init_sync),   DP_FIELD_SPAN(dp_fsdp_options, full_params_as_views),
  };
};

template <>
struct KnownFields<dp_ddp_stats> {
  static constexpr const char* kName = "dp_ddp_stats";
  static constexpr FieldSpan kFields[] = {
      DP_FIELD_SPAN(dp_ddp_stats, struct_size), DP_FIELD_SPAN(dp_ddp_stats, backward_ms),
      DP_FIELD_SPAN(dp_ddp_stats, reduce_ms),   DP_FIELD_SPAN(dp_ddp_stats, exposed_ms),
      DP_FIELD_SPAN(dp_ddp_stats, num_buckets), DP_FIELD_SPAN(dp_ddp_stats, buckets_rebuilt),
  };
};

template <>
struct KnownFields<dp_memory_stats> {
  static constexpr const char* kName = "dp_memory_stats";
  static constexpr FieldSpan kFields[] = {
      DP_FIELD_SPAN(dp_memory_stats, struct_size),
      DP_FIELD_SPAN(dp_memory_stats, allocated_bytes),
      DP_FIELD_SPAN(dp_memory_stats, peak_allocated_bytes),
      DP_FIELD_SPAN(dp_memory_stats, cached_bytes),
  };
};

#undef DP_FIELD_SPAN

}  // namespace dparallel::capi
