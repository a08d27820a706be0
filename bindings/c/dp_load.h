/* Loading libdparallel at run time: one dlopen, one dlsym("dp_get_api"), and
 * every call after that through the returned table.
 *
 *   dp_library lib;
 *   char why[512];
 *   if (dp_library_open(&lib, "libdparallel.so.0", DP_VERSION_MAJOR, why, sizeof why) != 0) {
 *     fprintf(stderr, "%s\n", why);
 *     return 1;
 *   }
 *   dp_tensor *t = NULL;
 *   lib.api->tensor_create(&t, DP_FLOAT32, 1, shape, device);
 *   ...
 *   dp_library_close(&lib);
 */
#ifndef DPARALLEL_BINDINGS_C_DP_LOAD_H
#define DPARALLEL_BINDINGS_C_DP_LOAD_H

#include <stddef.h>
#include <stdint.h>

#include "dparallel/dp_api.h"

typedef struct dp_library {
  void *handle;      /* from dlopen */
  const dp_api *api; /* the library's table for the major asked for */
} dp_library;

/* Loads the library at `path` (a file name searched the dlopen way, or a
 * path) and takes its table for ABI major `abi_major`. A library without that
 * major, or whose table is shorter than this header's, is refused: the
 * library is unloaded again. Returns 0, or -1 with the reason in `why`. */
int dp_library_open(dp_library *lib, const char *path, uint32_t abi_major, char *why, size_t cap);

/* Ends the library's own threads (dp_shutdown, so a host's exit does not
 * wait on them) and dlcloses it. Destroy every handle from it first. */
void dp_library_close(dp_library *lib);

#endif /* DPARALLEL_BINDINGS_C_DP_LOAD_H */
