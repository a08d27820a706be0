/* The umbrella header compiles as plain C99 and the library links from C. */
#include <stdio.h>

#include "dparallel/dparallel.h"

int main(void) {
  dp_device device;
  char text[16];
  if (dp_device_parse("cpu:1", &device) != DP_OK) return 1;
  if (dp_device_format(device, text, sizeof text) != DP_OK) return 2;
  if (dp_get_api(DP_VERSION_MAJOR) == NULL) return 3;
  printf("%s %u\n", text, dp_version_number());
  return 0;
}
