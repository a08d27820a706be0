/* An outside program built against the installed package: it adds a tensor
 * on cpu:0 to one on cpu:1 with dp_reduce_add and prints the sum, the
 * library's version and the file it loaded. */
#include <dparallel/dparallel.h>
#include <stdio.h>
#include <string.h>

static int check(dp_status status, const char *what) {
  if (status != DP_OK) fprintf(stderr, "consumer: %s: %s\n", what, dp_last_error());
  return status == DP_OK;
}

/* The path of the libdparallel this process mapped. */
static void print_loaded_library(void) {
  char line[4096];
  FILE *maps = fopen("/proc/self/maps", "r");
  if (maps == NULL) return;
  while (fgets(line, sizeof line, maps) != NULL) {
    const char *path = strchr(line, '/');
    if (path != NULL && strstr(path, "libdparallel.so") != NULL) {
      printf("loaded %s", path);
      break;
    }
  }
  fclose(maps);
}

int main(void) {
  const float a_values[4] = {1, 2, 3, 4}, b_values[4] = {10, 20, 30, 40};
  const int64_t shape[1] = {4};
  dp_device cpu0, cpu1;
  dp_tensor *a = NULL, *b = NULL, *sum = NULL;
  float out[4] = {0, 0, 0, 0};
  int ok = check(dp_device_parse("cpu:0", &cpu0), "dp_device_parse") &&
           check(dp_device_parse("cpu:1", &cpu1), "dp_device_parse") &&
           check(dp_tensor_create(&a, DP_FLOAT32, 1, shape, cpu0), "dp_tensor_create") &&
           check(dp_tensor_create(&b, DP_FLOAT32, 1, shape, cpu1), "dp_tensor_create") &&
           check(dp_tensor_copy_from_host(a, a_values, sizeof a_values), "dp_tensor_copy_from_host") &&
           check(dp_tensor_copy_from_host(b, b_values, sizeof b_values), "dp_tensor_copy_from_host");
  if (ok) {
    const dp_tensor *inputs[2] = {a, b};
    ok = check(dp_reduce_add(inputs, 2, cpu0, &sum), "dp_reduce_add") &&
         check(dp_tensor_copy_to_host(sum, out, sizeof out), "dp_tensor_copy_to_host");
  }
  dp_tensor_destroy(sum);
  dp_tensor_destroy(b);
  dp_tensor_destroy(a);
  if (!ok) return 1;
  printf("dparallel %u: cpu:0 + cpu:1 = %g %g %g %g\n", (unsigned)dp_version_number(), out[0], out[1], out[2], out[3]);
  print_loaded_library();
  return 0;
}
