// What a host asks of a new process group (process_group.h).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "core/device.h"
#include "distributed/backend_registry.h"
#include "distributed/store/store.h"

namespace dparallel::dist {

class Backend;

// A split's new group made from its parent's own connections (NCCL's
// ncclCommSplit), where every rank of the parent agreed that its backend
// can (Backend::splits_into), rather than new ones over the store.
struct BackendSplit {
  Backend* parent = nullptr;  // the parent group's backend: it outlives the creation
  int32_t color = 0;
  int32_t key = 0;
};

struct ProcessGroupOptions {
  BackendChoice backend = BackendChoice::kAuto;
  int32_t rank = -1;
  int32_t world_size = -1;
  std::shared_ptr<Store> store;
  Millis timeout{300000};
  Device device{DeviceType::kCpu, 0};
  std::string master_addr;  // where the store lives, when known: picks the network interface
  std::optional<BackendSplit> split;
  // A group inside a job whose ranks span hosts: its peers are often late
  // because they wait on the network, so shared-memory waits spin briefly
  // (shm/spin_budget.h).
  bool network_paced = false;
};

}  // namespace dparallel::dist
