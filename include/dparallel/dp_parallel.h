/* dparallel — running a host forward on every replica at once.
 *
 * The callback `fn` runs on dparallel's persistent worker thread of its
 * replica's device, with that device made current before each call (for
 * CUDA, the current device of that thread) and the caller's current streams
 * current there (dp_stream.h). Replicas run on distinct devices,
 * one thread each, so callbacks may wait on each other; repeated devices are
 * DP_EINVAL naming both indices.
 *
 * Borrowed handles: `replica` and `input` are the one deliberate exception
 * to "no borrowed handles". They stay owned by dparallel and are valid only
 * during the call; the callback must not destroy them or use them after it
 * returns (bindings wrap them as non-owning).
 *
 * Output: the callback returns 0 and stores in *output either a new tensor
 * reference it owns or `input` itself; either way dparallel takes it over
 * (the callback must not destroy it afterwards). A non-zero return is a
 * failure; whatever *output then holds (NULL, `input`, or a new reference) is
 * released by dparallel. It must not call dp_parallel_apply, dp_data_parallel
 * or dp_replica_set_apply (DP_ESTATE, checked before anything changes).
 *
 * Thread safety: calls may come from any thread, several at once, over the
 * same devices in any order. Each call's replicas are queued on their
 * devices' workers together, at the same place in every device's queue, so
 * concurrent calls all finish as long as callbacks wait only on replicas of
 * their own call (never on another call's callbacks, nor on anything that
 * needs another call to finish first). Calls that share a device take turns
 * on its worker. The replicas and inputs of one call (and a replica set) must
 * not be used elsewhere while it runs.
 */
#ifndef DPARALLEL_DP_PARALLEL_H
#define DPARALLEL_DP_PARALLEL_H

#include "dparallel/dp_replicate.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef int (*dp_forward_fn)(void *user_data, size_t replica_index, dp_module *replica, dp_tensor *input,
                             dp_device device, dp_tensor **output);

/* out[i] = fn(user_data, i, replicas[i], inputs[i], devices[i]) for every i, in
 * parallel. All run to completion; then the first failure in replica order is
 * returned (DP_EUSER for a callback's non-zero return or missing output, with
 * the replica index and the code in the message) and every other output is
 * released, leaving out[] NULL. Two replicas on one device (devices[i], or
 * with devices NULL each input's device) are DP_EINVAL. */
DP_API dp_status dp_parallel_apply(dp_module *const *replicas, dp_tensor *const *inputs,
                                   const dp_device *devices /* NULL: each input's device */, size_t n, dp_forward_fn fn,
                                   void *user_data, dp_tensor **out /* [n] */);
/* One device: fn is called directly, on the calling thread, with the module
 * itself (which must be on that device) and the input moved there. Several:
 * the input is scattered along `dim` (an input with fewer chunks than devices
 * uses only that many; CPU inputs are copied to the devices), the module
 * replicated, fn applied in parallel, the replicas' gradients reduced into the
 * module's (dp_reduce_gradients: zero them before a step), and the outputs
 * gathered along `dim` on `output_device`. No devices is DP_EINVAL. */
DP_API dp_status dp_data_parallel(dp_module *module, dp_tensor *input, const dp_device *devices, size_t ndevices,
                                  dp_device output_device, int32_t dim, dp_forward_fn fn, void *user_data,
                                  dp_tensor **out);
/* Scatter along `dim`, apply over the set's kept replicas, gather on
 * `output_device` (0-d outputs as in dp_data_parallel). Gradients stay in the
 * replicas until dp_replica_set_reduce_gradients. */
DP_API dp_status dp_replica_set_apply(dp_replica_set *set, dp_tensor *input, int32_t dim, dp_device output_device,
                                      dp_forward_fn fn, void *user_data, dp_tensor **out);

#ifdef __cplusplus
}
#endif

#endif /* DPARALLEL_DP_PARALLEL_H */
