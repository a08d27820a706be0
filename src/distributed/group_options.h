// What a host asks of a new process group (process_group.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/device.h"
#include "distributed/backend_registry.h"
#include "distributed/store/store.h"

namespace dparallel::dist {

struct ProcessGroupOptions {
  BackendChoice backend = BackendChoice::kAuto;
  int32_t rank = -1;
  int32_t world_size = -1;
  std::shared_ptr<Store> store;
  Millis timeout{300000};
  Device device{DeviceType::kCpu, 0};
  std::string master_addr;  // where the store lives, when known: picks the network interface
};

}  // namespace dparallel::dist
