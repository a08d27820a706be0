/* dp_load.h: dlopen, one dlsym, and the checks of the table's version. */
#include "dp_load.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

typedef const dp_api *(*get_api_fn)(uint32_t abi_major);

int dp_library_open(dp_library *lib, const char *path, uint32_t abi_major, char *why, size_t cap) {
  lib->handle = NULL;
  lib->api = NULL;
  if (path == NULL || path[0] == '\0') {
    snprintf(why, cap, "dp_library_open: path is empty");
    return -1;
  }
  void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (handle == NULL) {
    snprintf(why, cap, "cannot load %s: %s", path, dlerror());
    return -1;
  }
  /* POSIX lets a function pointer travel through dlsym's void *. */
  void *symbol = dlsym(handle, "dp_get_api");
  if (symbol == NULL) {
    snprintf(why, cap, "%s is not libdparallel: it has no dp_get_api", path);
    dlclose(handle);
    return -1;
  }
  get_api_fn get_api;
  memcpy(&get_api, &symbol, sizeof get_api);
  const dp_api *api = get_api(abi_major);
  if (api == NULL) {
    snprintf(why, cap, "refusing %s: it has no table for ABI major %u (this host was built for major %u)", path,
             (unsigned)abi_major, (unsigned)DP_VERSION_MAJOR);
    dlclose(handle);
    return -1;
  }
  if (api->abi_major != abi_major || api->struct_size < sizeof(dp_api)) {
    snprintf(why, cap,
             "refusing %s: its table is ABI %u.%u with %zu bytes; this host needs ABI %u.%u or later (%zu bytes)", path,
             (unsigned)api->abi_major, (unsigned)api->abi_minor, api->struct_size, (unsigned)abi_major,
             (unsigned)DP_API_MINOR, sizeof(dp_api));
    dlclose(handle);
    return -1;
  }
  lib->handle = handle;
  lib->api = api;
  return 0;
}

void dp_library_close(dp_library *lib) {
  /* The threads restart if another handle on the library uses it again. */
  if (lib->api != NULL) (void)lib->api->shutdown();
  if (lib->handle != NULL) dlclose(lib->handle);
  lib->handle = NULL;
  lib->api = NULL;
}
