// The distributed handles, shared by the capi/ files that take them.
#pragma once

#include <memory>
#include <vector>

#include "capi/capi_internal.h"
#include "core/process_origin.h"
#include "distributed/device_mesh.h"
#include "distributed/process_group.h"
#include "dparallel/dp_dist.h"

constexpr uint64_t kStoreTag = 0x6470'7374'6f72'6521ull;  // "dpstore!"
constexpr uint64_t kGroupTag = 0x6470'7072'6f63'6772ull;  // "dpprocgr"
constexpr uint64_t kWorkTag = 0x6470'776f'726b'2121ull;   // "dpwork!!"
constexpr uint64_t kMeshTag = 0x6470'6d65'7368'2121ull;   // "dpmesh!!"

// These handles talk to other processes, or wait on the library's threads:
// each knows the process it was made in, and a forked child may not use it
// (ProcessOrigin); destroying it there frees nothing and touches nothing.
struct dp_store {
  uint64_t tag = kStoreTag;
  std::shared_ptr<dparallel::dist::Store> store;
  dparallel::ProcessOrigin origin;
};

struct dp_process_group {
  uint64_t tag = kGroupTag;
  std::shared_ptr<dparallel::dist::ProcessGroup> group;
  dparallel::ProcessOrigin origin;
  bool borrowed = false;  // lent to a comm hook, or a mesh's own
};

struct dp_work {
  uint64_t tag = kWorkTag;
  std::shared_ptr<dparallel::dist::Work> work;
  dparallel::ProcessOrigin origin;
};

struct dp_device_mesh {
  uint64_t tag = kMeshTag;
  std::shared_ptr<dparallel::dist::DeviceMesh> mesh;
  // One borrowed handle per dimension, over the mesh's groups.
  std::vector<std::unique_ptr<dp_process_group>> groups;
  dparallel::ProcessOrigin origin;
};

namespace dparallel::capi {

dist::Store& store_arg(const dp_store* handle, const char* name);
dist::ProcessGroup& group_arg(const dp_process_group* handle, const char* name);
const dp_device_mesh& mesh_arg(const dp_device_mesh* handle, const char* name);
// kState naming `name` when `origin` is another process (this is a forked child).
void check_origin(const ProcessOrigin& origin, const char* name);
// The group's own transfer stream (NCCL's; none for others), for
// in_stream_order when the group's collectives read the host's tensors.
inline OtherStream transfer_stream_of(const dist::ProcessGroup& group) {
  return {group.device(), group.transfer_stream()};
}

}  // namespace dparallel::capi
