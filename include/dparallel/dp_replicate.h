/* dparallel — replication across devices and gradient reduction.
 *
 * Replicas have the module's structure and dotted names. Parameters and
 * buffers are broadcast coalesced from the module's device (all its tensors
 * must be on one device); a replica on that device shares the module's
 * storage, but every replica has its own gradients, so dp_reduce_gradients
 * adds each replica's gradient into the target's once. Children shared in the
 * module are shared inside each replica; NULL slots stay NULL.
 *
 * Thread safety: dp_replicate reads the module like any other reader.
 * dp_reduce_gradients reads the replicas and writes the target's gradients:
 * one writer of those gradients at a time, and no concurrent readers of
 * them. A dp_replica_set is used by one thread at a time; its replicas, once
 * handed out, follow dp_module.h's rules.
 */
#ifndef DPARALLEL_DP_REPLICATE_H
#define DPARALLEL_DP_REPLICATE_H

#include "dparallel/dp_module.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out[i] is a new replica on devices[i]. With `detach`, no parameter or buffer
 * of a replica requires grad; otherwise each keeps the module's flag. An empty
 * device list yields no replicas. */
DP_API dp_status dp_replicate(const dp_module *module, const dp_device *devices, size_t ndevices, int detach,
                              dp_module **out /* [ndevices] */);
/* For every parameter of `target` that requires grad: its gradient becomes its
 * old value plus the sum of the replicas' allocated gradients (of replica
 * parameters that require grad), on the target's device. Every replica must
 * have the target's parameter names, shapes and dtypes (DP_EINVAL names the
 * first difference). */
DP_API dp_status dp_reduce_gradients(dp_module *const *replicas, size_t nreplicas, dp_module *target);

/* Replicas kept across steps: made once, refreshed in place by _sync. */
typedef struct dp_replica_set dp_replica_set;
/* A device listed twice is DP_EINVAL naming both indices. */
DP_API dp_status dp_replica_set_create(dp_replica_set **out, dp_module *module, const dp_device *devices,
                                       size_t ndevices);
/* Copies the module's current parameters and buffers, and their
 * requires_grad flags, into the replicas' existing storage (call it after
 * updating or freezing/unfreezing the module). DP_ESTATE if the module, or a
 * replica from dp_replica_set_replica, gained or lost parameters or buffers
 * since the set was made. */
DP_API dp_status dp_replica_set_sync(dp_replica_set *set);
DP_API dp_status dp_replica_set_replica(const dp_replica_set *set, size_t index, dp_module **out);
/* dp_reduce_gradients from the replicas that took part in the latest
 * dp_replica_set_apply (all of them before the first) into the module, then
 * zeroes those replicas' gradients: every step starts with fresh replica
 * gradients (as when replicating anew each forward), so a callback may
 * accumulate into them. */
DP_API dp_status dp_replica_set_reduce_gradients(dp_replica_set *set);
DP_API void dp_replica_set_destroy(dp_replica_set *set);

/* Additions beyond the base contract. */

/* The number of replicas (devices); 0 for a NULL or invalid handle. */
DP_API size_t dp_replica_set_size(const dp_replica_set *set);

#ifdef __cplusplus
}
#endif

#endif /* DPARALLEL_DP_REPLICATE_H */
