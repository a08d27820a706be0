/* dparallel — DistributedDataParallel for any host: a gradient reducer with
 * the semantics of PyTorch's DDP (torch/csrc/distributed/c10d/reducer.cpp)
 * and its composable replicate.
 *
 * The host owns its tensors and its autograd. Each step:
 *   dp_ddp_pre_forward(ddp);                 broadcasts buffers (option)
 *   ...forward, then backward; as each parameter's gradient is final:
 *   dp_ddp_mark_grad_ready(ddp, "fc3.weight");   or _index / _stream
 *   dp_ddp_finish_backward(ddp);             the module's gradients now hold
 *                                            the average over every rank
 * A bucket's reduction starts, asynchronously, as soon as its last gradient
 * is marked (buckets start in index order), so communication overlaps the
 * host's remaining backward. On a shared-memory group (every rank on one
 * host, cpu) with a built-in hook and without find_unused_parameters,
 * every bucket is reduced once the last one is ready instead, in index
 * order (on_bucket_reduced runs for each before the next one's reduction):
 * there a reduction is memory-bound work on the cores the backward runs
 * on, so overlapping it slows the backward about as much as it hides, and
 * no bucket needs the save described under failures (bench/RESULTS.md). Average = sum divided by the world size. On a
 * cpu group with the default hook, without gradient_as_bucket_view and
 * find_unused_parameters, a bucket is one all-reduce straight over the
 * module's gradient tensors (no bucket memory, no copies); otherwise
 * gradients are copied into flat buckets as they are marked (or are views
 * into them) and the results copied back. In the first case, on a
 * shared-memory group, a dp_ddp created with init_sync gives every managed
 * parameter that has no gradient yet a zeroed one in memory the other ranks
 * map, where the all-reduce reads their values in place (no staging
 * copies; dp_device_memory_stats counts it); a gradient the host set or
 * fetched before create stays where it is, and while any rank has one the
 * reductions go through the segment instead.
 *
 * Managed parameters: those of `module` that require grad, in registration
 * order (dp_module_parameter_at), minus ignored modules (with all their
 * descendants) and ignored parameters. Their indices (for _index, _stream
 * and dp_ddp_bucket_parameters) count managed parameters only, from 0.
 * Names are relative to `module`; an unknown name is DP_EINVAL naming it.
 * A parameter can be managed by one live dp_ddp at a time (DP_EINVAL); several
 * dp_ddp over disjoint submodules of one module work side by side. Names and
 * the state dict are unchanged by wrapping.
 *
 * Buckets: per dtype and device, filled in reverse registration order; a
 * parameter joins its dtype's open bucket, which is closed once its size
 * reaches its cap (PyTorch's rule; each dtype's first bucket has
 * first_bucket_cap_mb, its later ones bucket_cap_mb; 1 MB = 2^20 bytes); a
 * parameter is never split. Buckets are numbered in the order of their
 * first parameter. The plan is the same on every rank. At the end of the
 * first synced finish_backward the buckets are rebuilt once, by the same
 * rule, in the order rank 0's gradients became ready (those it never marked
 * last), so that later iterations overlap better; with
 * gradient_as_bucket_view the gradient tensors are then replaced by views
 * of the new buckets, values kept. With gradient_as_bucket_view the
 * gradients' storage moves twice, and only then: at dp_ddp_create (a
 * gradient allocated or set before keeps its values in its new place) and
 * at that rebuild if the plan changed (dp_ddp_last_stats says so for that
 * iteration only). A handle from dp_module_grad follows the move; a pointer
 * taken from dp_tensor_data before it does not. A DLPack export of a
 * gradient (or a tensor made from one) taken before the move keeps the old
 * memory, with the values the gradient had at the move: the library never
 * writes it again, and the memory goes when the last of them does (the
 * new buckets never reuse it). On a shared-memory group
 * (with init_sync) the buckets, so the gradients too, lie in memory every
 * rank of the group maps, so that a reduction reads the other ranks'
 * gradients where they are.
 *
 * Errors: every rank that finds a problem reports it. finish_backward with
 * parameters never marked (without find_unused_parameters) is DP_ESTATE
 * naming them and suggesting the option; marking one twice in a backward is
 * DP_ESTATE. A finish_backward that waits past the group's timeout is
 * DP_ETIMEOUT naming the bucket, its parameters this rank has not seen
 * ready, and the ranks that did not arrive. A collective failure breaks the
 * group (see dp_dist.h) and leaves the dp_ddp usable only for destroy.
 *
 * Environment: DP_DEBUG=INFO logs the bucket plan and per-iteration timings
 * to stderr; DP_DEBUG=DETAIL also checks, before each bucket's reduction,
 * that every rank reduces the same bucket (index, size, dtype), failing with
 * DP_EINVAL naming the first difference. DP_TIMELINE=path writes a Chrome
 * trace (one track per rank) of ready marks, reductions and waits.
 *
 * Unused parameters (find_unused_parameters = 1): after the reductions the
 * ranks agree on which parameters any rank marked since the last synced
 * backward; those are averaged (a rank that did not mark one contributes
 * zeros, or what earlier unsynced backwards accumulated); a parameter no
 * rank marked keeps its gradient. Without the option, a parameter left
 * unmarked fails finish_backward on that rank (DP_ESTATE) and the other
 * ranks' matching reductions at once (DP_EINVAL naming that rank); the
 * group stays usable and the next backward starts afresh. The same holds
 * for a gradient that shares memory with another managed parameter's
 * gradient or value (dp_module_set_grad can make one, e.g. swapping two
 * gradients through the handles dp_module_grad returns, which follow their
 * parameter): DP_ESTATE naming both parameters, checked at the first mark
 * of a synced backward after any gradient was set.
 *
 * A failed finish_backward leaves every managed gradient as this rank
 * computed it (its own, unaveraged values), also in buckets reduced before
 * the failure, so the host may retry or skip the step; the next backward
 * starts afresh. Two failures are not undone: DP_ETIMEOUT (a reduction
 * still runs, the dp_ddp is unusable) and a failure of the group itself.
 * With gradients in shared memory, a peer stalled past the timeout that
 * resumes later writes nothing into this rank's gradients: a failed
 * reduction makes this rank's part of the region memory of its own.
 * For this the reducer saves a bucket's own values just before reducing it
 * while a failure can still follow: not for the last bucket once the plan
 * is rebuilt (every rank has marked everything when it runs), and, where
 * every bucket waits for the last one (above), not after the first
 * iteration; the saves cost memory the size of those buckets.
 *
 * A gradient marked ready belongs to the library until finish_backward
 * returns: the host must neither read nor write it in between (its bucket
 * may be reduced, and the result written back, while the backward goes on).
 *
 * Several dp_ddp on one group (disjoint submodules): every collective any
 * of them issues (bucket reductions, the used map, the ready order, buffer
 * broadcasts, the checks at create) runs on one library thread per group,
 * and the ranks pair them by identity, never by arrival: each dp_ddp's
 * jobs are numbered in its own order (the same on every rank), and in
 * rounds the ranks agree which jobs every rank has issued and run those,
 * by dp_ddp then number. Every call carries that identity in its header,
 * so ranks that would pair two different jobs fail naming both. The host
 * may therefore mark from any threads, in any order, and finish the dp_ddp
 * in any order, differently on each rank. What a rank must keep in order:
 * dp_ddp_create and dp_ddp_pre_forward (they wait for their collectives)
 * in the same order of dp_ddp on every rank; and where a rank finishes a
 * dp_ddp with parameters it did not mark (unused, or a forgotten mark),
 * the jobs waiting for that finish run only then, so if two dp_ddp on the
 * group each have such a rank, finish those two in the same order on every
 * rank (else the finishes wait for each other until DP_ETIMEOUT).
 *
 * Thread safety: mark_grad_ready (all three forms) may be called from
 * several threads at once; every other call on one dp_ddp must not overlap
 * another. The comm hook runs on the library's worker thread (its own
 * collectives on the group are part of its job). A collective of the
 * host's own on the group while any dp_ddp on it is in a backward (from its
 * first mark to the end of its finish_backward) or has collectives queued
 * or running is refused at once on the calling rank: DP_ESTATE naming the
 * dp_ddp, nothing sent, the group still usable. Make such calls on every
 * rank before the first mark or after every finish_backward. The module's managed parameters
 * must not be reallocated or freed while the dp_ddp lives; its gradients
 * may be replaced between backwards (dp_module_set_grad). Tied parameters:
 * handles over the same memory, dtype and shape are one parameter, counted
 * once; parameters that overlap in memory otherwise are DP_EINVAL at
 * dp_ddp_create naming both.
 * A dp_ddp belongs to the process that created it: in a forked child every
 * call on an inherited one is DP_ESTATE and its destroy frees nothing;
 * gradients in shared memory (above) stay shared with the parent there.
 */
#ifndef DPARALLEL_DP_DDP_H
#define DPARALLEL_DP_DDP_H

#include "dparallel/dp_dist.h"
#include "dparallel/dp_module.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum dp_comm_hook {
  DP_HOOK_ALLREDUCE = 0, /* sum, then divide by the world size */
  DP_HOOK_FP16 = 1,      /* cast to float16, reduce, cast back, divide */
  DP_HOOK_BF16 = 2,      /* cast to bfloat16, reduce, cast back, divide */
  DP_HOOK_CUSTOM = 3     /* hook_fn reduces the flat bucket in place */
} dp_comm_hook;
/* Receives the flat bucket (the concatenated gradients of bucket
 * `bucket_index`, this rank's values) and must leave in it what the module's
 * gradients should hold, typically by collectives on `pg`. Both handles are
 * valid only during the call; destroying them there is refused (nothing
 * is destroyed; dp_last_error says why). Returns 0 on success; non-zero
 * fails finish_backward with DP_EUSER. Runs on the library's worker thread.
 * A hook may run collectives on `pg`, use dp_tensor functions and read a
 * dp_ddp (num_buckets, bucket_parameters, last_stats); any other dp_ddp
 * call from a hook (on its own dp_ddp or another) would wait for the hook's
 * own bucket, so it is refused at once with DP_ESTATE, and dp_ddp_destroy
 * there destroys nothing.
 *
 * A hook that does not return makes its finish_backward DP_ETIMEOUT once
 * the group's timeout plus 3 s has passed with no bucket done. Every
 * dp_ddp on that group then shares one stuck lane: their queued and later
 * reductions fail at once with DP_ESTATE naming the hook's bucket, and
 * their destroy returns at once; the hook is left running, and what it
 * uses stays alive until it returns. The other ranks' lanes wait for this
 * one in their next agreement round: it fails at the group's timeout
 * (DP_ETIMEOUT naming the rank that did not arrive), and so do their
 * dp_ddp's pending jobs. Make a new group to go on. */
typedef int (*dp_comm_hook_fn)(void *user_data, dp_process_group *pg, size_t bucket_index, dp_tensor *flat_bucket);

typedef struct dp_ddp dp_ddp;
/* The optimizer inside backward: runs on the library's worker thread as
 * soon as bucket `bucket_index`'s averaged gradients are final in the
 * module's gradients (with find_unused_parameters before the static graph
 * is recorded: once the used map has decided, during finish_backward),
 * while later buckets still reduce (on a shared-memory group, where the
 * reductions wait for the last bucket: before the next bucket's reduction
 * starts, its gradients still in cache). Every managed parameter is reported
 * exactly once per synced iteration (unused ones too: dp_ddp_parameter_used
 * tells them apart, for the iteration being reduced), never in a no_sync
 * one. `param_indices` is valid during the call only. Returns 0; non-zero
 * makes finish_backward DP_EUSER naming the bucket (the gradients are
 * averaged and final all the same). Like a comm hook it may read the dp_ddp
 * and use dp_tensor and dp_module functions, but other dp_ddp calls are
 * DP_ESTATE. When finish_backward fails for another reason, buckets
 * reported before the failure keep what the callback did with them while
 * the gradients return to this rank's own values. */
typedef int (*dp_bucket_reduced_fn)(void *user_data, dp_ddp *ddp, size_t bucket_index, const size_t *param_indices,
                                    size_t nparams);

typedef struct dp_ddp_options {
  size_t struct_size;
  double bucket_cap_mb;               /* 25 */
  double first_bucket_cap_mb;         /* 1 */
  int gradient_as_bucket_view;        /* 0; 1: gradients are views into the buckets (no copy) */
  int broadcast_buffers;              /* 1: dp_ddp_pre_forward broadcasts buffers from rank 0 */
  int find_unused_parameters;         /* 0 */
  int init_sync;                      /* 1: check agreement, then broadcast from rank 0 */
  const char *const *ignored_modules; /* dotted module names; descendants ignored too */
  size_t num_ignored_modules;
  const char *const *ignored_parameters; /* dotted parameter names */
  size_t num_ignored_parameters;
  int32_t comm_hook; /* dp_comm_hook */
  dp_comm_hook_fn hook_fn;
  void *hook_user_data;
  /* ---- abi_minor 6 ---- */
  /* 0; 1: the first synced iteration records the used parameters, their
   * order and the plan; later iterations run no used-map collective (even
   * with find_unused_parameters), recorded-unused parameters go in as zeros
   * from the first mark, and an iteration that marks a recorded-unused
   * parameter (that mark is DP_ESTATE) or leaves a recorded-used one
   * unmarked fails finish_backward with DP_ESTATE naming it on every rank.
   * The last bucket of such iterations starts at finish_backward. */
  int static_graph;
  /* 1; while ranks have joined (dp_ddp_join), the built-in hooks divide by
   * the initial world size (1, PyTorch's default) or by the ranks still
   * active (0); a custom hook divides as it likes. */
  int join_divide_by_initial_world_size;
  dp_bucket_reduced_fn on_bucket_reduced; /* NULL */
  void *on_bucket_reduced_data;
  /* NULL; text from dp_ddp_bucket_plan to start with: the buckets are those,
   * final (no rebuild after the first iteration). DP_EINVAL at create naming
   * an unknown, repeated or missing parameter or a wrong dtype; ranks given
   * different plans fail on every rank at create (with init_sync 0, every
   * rank must give a plan or none). */
  const char *bucket_plan;
} dp_ddp_options;
#define DP_DDP_OPTIONS_INIT                                                                                           \
  {                                                                                                                   \
    sizeof(dp_ddp_options), 25.0, 1.0, 0, 1, 0, 1, NULL, 0, NULL, 0, DP_HOOK_ALLREDUCE, NULL, NULL, 0, 1, NULL, NULL, \
        NULL                                                                                                          \
  }
/* Fills the caller's struct with the defaults above, writing exactly
 * `struct_size` bytes: pass sizeof(dp_ddp_options). Bytes past the fields
 * this library knows are zeroed and opts->struct_size becomes `struct_size`,
 * as with dp_process_group_options_init. DP_EINVAL for a struct_size below
 * sizeof(size_t) or one that ends inside a field (no header's size). */
DP_API dp_status dp_ddp_options_init(dp_ddp_options *opts, size_t struct_size);

/* Wraps `module` for data-parallel training over `pg` (every rank calls it
 * with equal options). Holds references to the module and the group. With
 * init_sync, every rank checks that parameter count, names, dtypes and
 * shapes agree (an error names the first mismatch, the rank and both
 * values, on every rank), then parameters and buffers are broadcast from
 * rank 0. With init_sync or a bucket_plan, an argument error found on one
 * rank (an option, the module, `out`; not `pg`) takes the creation's place:
 * every rank fails at once with DP_EINVAL naming that rank ("rank 1
 * refused: ..."), and the group stays usable. */
DP_API dp_status dp_ddp_create(dp_ddp **out, dp_module *module, dp_process_group *pg,
                               const dp_ddp_options *opts /* may be NULL */);
/* With broadcast_buffers, broadcasts the module's buffers from rank 0. */
DP_API dp_status dp_ddp_pre_forward(dp_ddp *ddp);
DP_API dp_status dp_ddp_mark_grad_ready(dp_ddp *ddp, const char *param_name);
DP_API dp_status dp_ddp_mark_grad_ready_index(dp_ddp *ddp, size_t param_index);
/* Waits for every bucket, leaves the averaged gradients in the module's
 * gradient tensors and resets for the next iteration. */
DP_API dp_status dp_ddp_finish_backward(dp_ddp *ddp);
/* 0: later backwards only accumulate gradients locally (no communication);
 * the next synced backward reduces the accumulated sum. Such a backward is
 * still driven as any other: the host marks its gradients ready (each once,
 * as always) and calls dp_ddp_finish_backward, which then returns at once;
 * a parameter marked in any of them counts as used for the synced one. */
DP_API dp_status dp_ddp_set_requires_gradient_sync(dp_ddp *ddp, int requires_sync);
/* 0 (and dp_last_error set) for a NULL or invalid handle. */
DP_API size_t dp_ddp_num_buckets(const dp_ddp *ddp);
/* Bucket `bucket`'s managed-parameter indices in their order inside it:
 * `*count` receives how many; up to `cap` of them go to `indices` (which may
 * be NULL when cap is 0). */
DP_API dp_status dp_ddp_bucket_parameters(const dp_ddp *ddp, size_t bucket, size_t *indices, size_t cap, size_t *count);
/* Drops its queued reductions, waits for the running one (bounded by the
 * group's timeout plus 3 s), releases the module and the group; NULL is
 * accepted. A comm hook that never returns is left running (see below). */
DP_API void dp_ddp_destroy(dp_ddp *ddp);

/* Additions beyond the base contract. */

/* The gradient is final once the work queued so far on `cuda_stream`
 * completes: a cudaStream_t of the parameter's GPU, or for a cpu parameter a
 * stream from dp_stream_create (dp_stream.h); NULL is the legacy default
 * stream. The library waits on an event, never the whole device. The other
 * two forms use the marking thread's current stream for the parameter's
 * device, or the legacy default stream where none is set. DP_EINVAL when the
 * stream is not one of the parameter's device. */
DP_API dp_status dp_ddp_mark_grad_ready_stream(dp_ddp *ddp, size_t param_index, void *cuda_stream);
/* What the last synced iteration cost: the time from the first ready mark
 * to the end of finish_backward, the time the reductions ran, and the part
 * of it not hidden behind the host's backward (spent inside
 * finish_backward; never more than reduce_ms). num_buckets is the current
 * plan's; buckets_rebuilt is 1 only when that iteration's finish_backward
 * rebuilt the buckets into another plan (with gradient_as_bucket_view: the
 * gradients' storage moved then), 0 otherwise and on later iterations. */
typedef struct dp_ddp_stats {
  size_t struct_size;
  double backward_ms;
  double reduce_ms;
  double exposed_ms;
  size_t num_buckets;
  int buckets_rebuilt;
} dp_ddp_stats;
DP_API dp_status dp_ddp_last_stats(const dp_ddp *ddp, dp_ddp_stats *out);

/* Uneven inputs: this rank has no more data. It passes every dp_ddp it
 * drives (the same ones, in the same order, on every rank) and from then on
 * stands in for the other ranks' iterations: zeros for their bucket
 * reductions (so their averages divide as join_divide_by_initial_world_size
 * says), nothing used in their used map, their buffer broadcasts, their
 * plan's rebuild. It returns once every rank has joined; then every rank
 * holds the parameters and buffers of the rank that ran the most synced
 * iterations (the highest such rank), broadcast, and that rank's iteration
 * count. A rank may join before any iteration. The active ranks learn of a
 * join from the agreement rounds their collectives already run: an
 * iteration costs nothing more for it. While a rank is joined, the others
 * call dp_ddp_pre_forward every iteration if broadcast_buffers is on, make
 * no collectives of their own on the group, and each of their iterations
 * must take less than the group's timeout (the joined rank waits in
 * collectives meanwhile). DP_ESTATE during a backward (join after
 * dp_ddp_finish_backward); DP_EINVAL for n 0, a repeated dp_ddp or dp_ddp
 * on different groups. */
DP_API dp_status dp_ddp_join(dp_ddp *const *ddps, size_t n);
/* *out = 1 when some rank used parameter `param_index` in the last synced
 * iteration (inside on_bucket_reduced: the one being reduced), else 0:
 * without find_unused_parameters every parameter counts as used. A host
 * with Adam or weight decay skips those with 0 (their gradients read as
 * zeros). DP_ESTATE before any synced iteration has reduced gradients. */
DP_API dp_status dp_ddp_parameter_used(const dp_ddp *ddp, size_t param_index, int *out);
/* The current bucket plan as text: one line per bucket in launch order,
 * "bucket <dtype> <dotted names...>" (names with spaces, control bytes or
 * '%' percent-encoded), under a comment line; stable across runs of the
 * same module. Copies the text and a terminating NUL into `buf` and its
 * length (without the NUL) into *len; with buf NULL and cap 0 it only
 * reports the length. A `cap` below the length + 1 is DP_EINVAL (the
 * message and *len give the length; nothing is written to buf). */
DP_API dp_status dp_ddp_bucket_plan(const dp_ddp *ddp, char *buf, size_t cap, size_t *len);
/* Elastic training: the dp_ddp goes on over `pg`, another group (a shrunk
 * one after a peer failed, a grown one, or the same group: a re-sync).
 * Every rank of `pg` calls it, between iterations. Nothing is sent on the
 * old group, which may be broken, and no time is spent waiting for it
 * unless a reduction of this dp_ddp still runs there (then up to its
 * timeout plus 3 s, as dp_ddp_destroy). Collective over `pg`: as
 * dp_ddp_create with init_sync, the ranks check that their parameters
 * agree, then the parameters and buffers are broadcast from pg's rank 0.
 * Kept: the options, the current bucket plan (final from then on: no
 * rebuild), the comm hook (a custom hook receives `pg` from then on),
 * on_bucket_reduced, the dp_ddp_set_requires_gradient_sync setting.
 * Begun afresh: the averages divide by pg's size, the static graph is
 * recorded again by the first synced iteration, dp_ddp_join's state,
 * dp_ddp_last_stats and dp_ddp_parameter_used (DP_ESTATE until the next
 * synced iteration), the used marks of unsynced backwards. With
 * gradient_as_bucket_view the gradients move into the new buckets, values
 * kept, as at dp_ddp_create. Errors: DP_EINVAL naming 'ddp' or 'pg' for a
 * handle that is not one, or naming 'pg' for a group on another device than
 * the parameters; DP_ESTATE during a backward (from the first mark to the
 * end of dp_ddp_finish_backward; a backward that failed with DP_ETIMEOUT
 * does not count) or from inside a comm hook or on_bucket_reduced. These
 * refusals change nothing: the dp_ddp goes on over its old group, and the
 * other ranks' rebind fails as a collective that a rank never joined. A
 * failure of the new group's collectives (a rank's parameters that
 * disagree, a peer that fails or never calls) leaves the dp_ddp unusable:
 * every later call is DP_ESTATE naming the failed rebind, and
 * dp_ddp_destroy frees it. Thread safety: as any call that changes the
 * dp_ddp, it must not overlap another call on it; a call that does all the
 * same never touches a freed reducer: it runs on the old one or the new one
 * or fails with DP_ESTATE. */
DP_API dp_status dp_ddp_rebind(dp_ddp *ddp, dp_process_group *pg);

#ifdef __cplusplus
}
#endif

#endif /* DPARALLEL_DP_DDP_H */
