// The runtime of cpu devices: host memory, copied and zeroed by the host kernels.
#pragma once

namespace dparallel::cpu {

// Registers the cpu device runtime with the core (idempotent).
void register_runtime();

}  // namespace dparallel::cpu
