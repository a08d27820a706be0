#include "dpgo.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "_cgo_export.h"

const dp_api *dpgo_open(const char *path, uint32_t major, void **handle, char *err, size_t cap) {
  *handle = NULL;
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    snprintf(err, cap, "dlopen: %s", dlerror());
    return NULL;
  }
  typedef const dp_api *(*get_api_fn)(uint32_t);
  get_api_fn get_api;
  /* The ISO C way to turn dlsym's object pointer into a function pointer. */
  void *sym = dlsym(lib, "dp_get_api");
  if (sym == NULL) {
    snprintf(err, cap, "%s has no dp_get_api: %s", path, dlerror());
    dlclose(lib);
    return NULL;
  }
  memcpy(&get_api, &sym, sizeof get_api);
  const dp_api *api = get_api(major);
  if (api == NULL || api->abi_major != major) {
    snprintf(err, cap, "%s does not provide ABI major %u (this binding's); it is a different major version", path,
             (unsigned)major);
    dlclose(lib);
    return NULL;
  }
  if (api->struct_size < sizeof(dp_api)) {
    snprintf(err, cap, "%s provides ABI %u.%u, older than the %u.%u this binding needs", path, (unsigned)api->abi_major,
             (unsigned)api->abi_minor, (unsigned)major, (unsigned)DP_API_MINOR);
    dlclose(lib);
    return NULL;
  }
  *handle = lib;
  return api;
}

int dpgo_close(void *handle, char *err, size_t cap) {
  if (dlclose(handle) == 0) return 0;
  snprintf(err, cap, "dlclose: %s", dlerror());
  return -1;
}

static int forward(void *user_data, size_t index, dp_module *replica, dp_tensor *input, dp_device device,
                   dp_tensor **output) {
  return dpgoForward((uintptr_t)user_data, index, replica, input, device, output);
}

dp_status dpgo_parallel_apply(const dp_api *a, dp_module *const *replicas, dp_tensor *const *inputs,
                              const dp_device *devices, size_t n, uintptr_t call, dp_tensor **out) {
  return a->parallel_apply(replicas, inputs, devices, n, forward, (void *)call, out);
}

dp_status dpgo_data_parallel(const dp_api *a, dp_module *module, dp_tensor *input, const dp_device *devices,
                             size_t ndevices, dp_device output_device, int32_t dim, uintptr_t call, dp_tensor **out) {
  return a->data_parallel(module, input, devices, ndevices, output_device, dim, forward, (void *)call, out);
}

dp_status dpgo_replica_set_apply(const dp_api *a, dp_replica_set *set, dp_tensor *input, int32_t dim,
                                 dp_device output_device, uintptr_t call, dp_tensor **out) {
  return a->replica_set_apply(set, input, dim, output_device, forward, (void *)call, out);
}

static int comm_hook(void *user_data, dp_process_group *pg, size_t bucket_index, dp_tensor *flat_bucket) {
  return dpgoCommHook((uintptr_t)user_data, pg, bucket_index, flat_bucket);
}

static int bucket_reduced(void *user_data, dp_ddp *ddp, size_t bucket_index, const size_t *param_indices,
                          size_t nparams) {
  /* Go's exported signature has no const; the callback only reads them. */
  return dpgoBucketReduced((uintptr_t)user_data, ddp, bucket_index, (size_t *)param_indices, nparams);
}

void dpgo_ddp_set_callbacks(dp_ddp_options *o, int hook, int reduced, uintptr_t call) {
  if (hook) {
    o->hook_fn = comm_hook;
    o->hook_user_data = (void *)call;
  }
  if (reduced) {
    o->on_bucket_reduced = bucket_reduced;
    o->on_bucket_reduced_data = (void *)call;
  }
}

static void release_blob(void *ctx) { dpgoRelease((uintptr_t)ctx); }

dp_status dpgo_tensor_from_blob(const dp_api *a, dp_tensor **out, void *data, int32_t dtype, int32_t ndim,
                                const int64_t *shape, dp_device device, uintptr_t release) {
  return a->tensor_from_blob(out, data, dtype, ndim, shape, device, release != 0 ? release_blob : NULL,
                             (void *)release);
}

static void host_func(void *user_data) { dpgoHostFunc((uintptr_t)user_data); }

dp_status dpgo_stream_launch_host_func(const dp_api *a, dp_device device, void *stream, uintptr_t call) {
  return a->stream_launch_host_func(device, stream, host_func, (void *)call);
}

#define DPGO_DEFINE(ret, name, params, args) \
  ret dpgo_##name params { return a->name args; }
#define DPGO_DEFINE_VOID(name, params, args) \
  void dpgo_##name params { a->name args; }
DPGO_FORWARDERS(DPGO_DEFINE, DPGO_DEFINE_VOID)
