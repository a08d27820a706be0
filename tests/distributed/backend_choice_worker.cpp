// One rank of a backend-choice test: joins a cpu group from the launcher's
// environment asking for the backend in DP_TEST_BACKEND, and prints what it
// got: "status <n>", then "backend <name>" and the sum of an all_reduce of
// rank + 1, or "error <message>".
#include <cstdio>
#include <cstdlib>

#include "dparallel/dp_dist.h"

int main() {
  const char* asked = std::getenv("DP_TEST_BACKEND");
  dp_process_group_options opts = DP_PROCESS_GROUP_OPTIONS_INIT;
  opts.backend = asked == nullptr ? DP_BACKEND_AUTO : std::atoi(asked);
  opts.timeout_ms = 30000;
  dp_process_group* pg = nullptr;
  dp_status status = dp_process_group_create_from_env(&pg, &opts);
  std::printf("status %d\n", static_cast<int>(status));
  if (status != DP_OK) {
    std::printf("error %s\n", dp_last_error());
    return 0;
  }
  std::printf("backend %s\n", dp_process_group_backend(pg));
  float value = static_cast<float>(dp_process_group_rank(pg) + 1);
  int64_t shape[1] = {1};
  dp_tensor* t = nullptr;
  dp_device cpu = {DP_DEVICE_CPU, 0};
  if (dp_tensor_create(&t, DP_FLOAT32, 1, shape, cpu) != DP_OK ||
      dp_tensor_copy_from_host(t, &value, sizeof value) != DP_OK || dp_pg_all_reduce(pg, t, DP_SUM) != DP_OK ||
      dp_tensor_copy_to_host(t, &value, sizeof value) != DP_OK) {
    std::printf("collective failed: %s\n", dp_last_error());
    return 1;
  }
  std::printf("sum %g\n", static_cast<double>(value));
  dp_tensor_destroy(t);
  dp_process_group_destroy(pg);
  return 0;
}
