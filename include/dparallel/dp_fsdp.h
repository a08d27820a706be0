/* dparallel — fully_shard: sharded data parallel with the semantics of
 * PyTorch's FSDP2 (torch/distributed/fsdp/_fully_shard), composable with
 * dp_ddp as replicate is.
 *
 * Each rank keeps only its rows of every parameter a dp_fsdp manages: the
 * rows [r*c, min((r+1)*c, rows)) of dim 0, c = ceil(rows / world), the way
 * torch.chunk(world) splits them (a rank may keep none: see "Shards that
 * hold nothing" below). A 0-d parameter is not sharded: every rank keeps it
 * whole and its gradient is all-reduced.
 *
 * What dp_fsdp_create does to the host's memory: each managed parameter's
 * shard is a copy, in memory of the library's own, and the module's slot
 * holds it from then on; the slot drops the tensor the host registered
 * (with init_sync, after rank 0's values were first copied into it on
 * every rank). The library never reads or writes that memory again: it is
 * released once the host's own handles on it are gone (at once, through
 * dp_tensor_from_blob's deleter, when the module held the last reference),
 * and a handle or a dp_tensor_data pointer the host kept still names it,
 * not the parameter. The same holds for each managed parameter's gradient:
 * create drops it, whether dp_module_grad allocated it or dp_module_set_grad
 * set it over the host's memory (its deleter runs once the host's handles
 * are gone too), and the shard gradients start at zero. So after create
 * the host re-queries everything: the shard and its gradient through
 * dp_fsdp_shard / dp_fsdp_shard_grad (fixed for the dp_fsdp's life), the
 * full parameters through dp_module_get_parameter while unsharded (each at
 * one address for the dp_fsdp's life: "Full parameters keep one address"
 * below) and their gradients through dp_module_grad in each backward (new
 * tensors each backward), never a pointer taken before create.
 * dp_fsdp_destroy gives the slots full parameters in new memory, neither
 * the host's first tensors nor the unshards' ones, and drops the gradients
 * again.
 *
 * The host drives it around its own forward and backward, per dp_fsdp,
 * children first:
 *   dp_fsdp_unshard(f, 0);           all-gather: the slots hold full parameters
 *   ...forward of the module...
 *   dp_fsdp_reshard(f);              the slots hold the shards again (ZeRO-3)
 *   ...
 *   dp_fsdp_unshard(f, 0);           before the module's backward
 *   ...backward: fills dp_module_grad (full size) of each parameter...
 *   dp_fsdp_post_backward(f);        reshards; reduce-scatters the averaged
 *                                    gradients into the shard gradients
 *   dp_fsdp_finish_backward(f);      waits for it
 *   ...the optimizer steps on dp_fsdp_shard / dp_fsdp_shard_grad...
 dp_fsdp_unshard(f, 1) starts the all-gather and returns at once, so that
 * the next module's parameters arrive while the host computes (prefetch).
 * All its parameters travel in one all-gather per unshard (each padded to c
 * rows; none with full_params_as_views, below) and their gradients in one
 * reduce-scatter per reduce dtype. A host whose autograd reports each
 * gradient may mark them one by one instead of calling post_backward
 * (dp_fsdp_mark_grad_ready).
 *
 * The unshard protocol. Every rule on unshard, wait_unshard, reshard and
 * shards that hold nothing is here; the calls below refer to it.
 * - States: resharded (the slots hold the shards: after create, after
 *   post_backward, after reshard with reshard_after_forward = 1),
 *   unsharding (an async unshard issued, not completed) and unsharded (the
 *   slots hold the full parameters, in param_dtype).
 * - dp_fsdp_unshard from resharded issues the all-gather; blocking, it
 *   returns once the slots hold the full parameters, async, at once.
 *   Repeated: an unshard while unsharding or unsharded issues nothing and
 *   makes no collective (a rank may repeat it where another does not); a
 *   blocking one while unsharding completes the one in flight.
 * - dp_fsdp_wait_unshard completes an unshard in flight; while unsharded it
 *   returns at once; while resharded (none issued since the last reshard or
 *   post_backward, or the one issued failed and was reported) it is
 *   DP_ESTATE.
 * - dp_fsdp_reshard and dp_fsdp_post_backward complete an unshard in flight
 *   first (as do the full state dict saves and dp_fsdp_destroy). reshard
 *   then puts the shards back (ZeRO-3, reshard_after_forward = 1, the
 *   default), except that with reshard_after_forward = 0 (ZeRO-2) it keeps
 *   the full parameters between an unshard and the next post_backward; a
 *   reshard while resharded does nothing. post_backward always reshards.
 * - post_backward with no unshard since the last post_backward is
 *   DP_ESTATE (no full gradient can have been computed), except after the
 *   marks ran it (a no-op, see dp_fsdp_mark_grad_ready).
 * - An unshard in flight reads the shards: the host must not write a shard
 *   until it completes. A gradient is taken or set only while unsharded.
 * - Shards that hold nothing: a rank past a parameter's last row (rows <=
 *   r*c, and every rank for a parameter of 0 rows) keeps a shard of 0 rows
 *   and a shard gradient of 0 rows: dp_fsdp_shard and dp_fsdp_shard_grad
 *   give such tensors (never NULL), the slot holds one while resharded, and
 *   the rank takes part in every all-gather and reduce-scatter as the
 *   others do. With full_params_as_views such a shard lies in memory of its
 *   own, apart from the full parameter's. A dp_fsdp that manages no
 *   parameter at all (its module's parameters are all held by children's)
 *   is not an error: it goes through the same states and the same errors,
 *   and none of its calls after create makes a collective (create with
 *   init_sync does).
 *
 * - Mixed precision: param_dtype (DP_BFLOAT16, DP_FLOAT16, ...) is the dtype
 *   of the full parameters and of their full gradients, the shards keep
 *   their own; the all-gather moves param_dtype. Gradients are reduced in
 *   reduce_dtype (default param_dtype; 16-bit dtypes are divided by the
 *   world size before the sum, so that it cannot overflow) and added to the
 *   shard gradients in the shards' dtype.
 * - Gradients: the shard gradients accumulate (the reduced average is added
 *   to them) until the host zeroes them (dp_module_zero_grad on the module
 *   zeroes them too; with a post_backward in flight it first waits for it,
 *   as dp_fsdp_finish_backward does, and reports its failure, so the zeros
 *   stand). With dp_fsdp_set_requires_gradient_sync(f, 0),
 *   post_backward makes no collective and keeps the full gradients, which
 *   later backwards add to; the next synced post_backward reduces the sum.
 *   A gradient never taken is reduced as zeros. Parameters that do not
 *   require grad at create are sharded but not reduced.
 * - Memory: the full parameters' pages go at each reshard that puts the
 *   shards back (below), and the full gradients after their reduce-scatter
 *   (back to the allocator unless the host still holds a handle to them);
 *   full parameters that are views (below) take none.
 *
 * Full parameters keep one address, as FSDP2 keeps one unsharded tensor per
 * parameter and frees only its storage: from create to dp_fsdp_destroy,
 * each managed parameter's full tensor (what dp_module_get_parameter gives
 * while unsharded) is the same tensor, and dp_tensor_data of it the same
 * address, at every unshard. A host binds it once, and a view of it its
 * autograd saved in the forward sees what the backward's unshard refills.
 * Its memory is reserved once: every unshard backs it with pages and writes
 * the gathered values there; every reshard that puts the shards back (and
 * post_backward, and destroy) gives the pages back: at the call where the
 * work queued so far on the host's current stream and the library's own
 * stream (which may read them) is done, else once it is, from a library
 * thread, so that the call never waits on the host for the host's queued
 * work (an unshard before then keeps them). Meanwhile a handle, view or
 * pointer kept on it still names that address, and:
 * - on the CPU the pages are given back to the system (MADV_DONTNEED over
 *   a private anonymous mapping): reads give zeros (once they went, with
 *   DP_CPU_ASYNC=1 after the queued work) until the next unshard
 *   refills them; a write there takes a page back (which the next unshard
 *   overwrites and the next reshard gives back): do not write.
 * - on a GPU with the driver's virtual memory management (VMM: the range
 *   reserved with cuMemAddressReserve, its memory mapped with cuMemCreate
 *   and cuMemMap at unshard and unmapped and released at reshard) nothing
 *   is mapped there once the pages went: it must not be touched (a kernel
 *   that does faults).
 * - on a GPU without VMM (or with DP_CUDA_VMM=0 in the environment) the
 *   memory is allocated at create and kept until the dp_fsdp and every
 *   handle on it are gone: the address holds the same way, reads while
 *   resharded see the last unshard's values, and reshard saves no memory.
 * dp_device_memory_stats counts the pages while held. After destroy the
 * slots hold new tensors; a handle kept on an unshard's one keeps its
 * address range reserved (without pages, on the CPU and with VMM) until
 * the handle goes. Views (below) are the shards' memory itself: their
 * address is fixed at create, and they keep their pages. Full gradients
 * are not kept: dp_module_grad makes new ones in each backward (or the
 * host sets them).
 *
 * Composition: a dp_fsdp manages the parameters of `module` that no live
 * dp_fsdp holds, so create the children's first (one left with none: see
 * the unshard protocol). dp_ddp_create over a parent leaves every
 * parameter a live dp_fsdp holds alone (replicate over fully_shard). A
 * dp_ddp and any number of dp_fsdp on one process group issue their
 * collectives through the group's one ordered lane, so hosts may interleave
 * them in any order, the same on every rank. Create them in the same order
 * on every rank.
 *
 * dp_module_save and replication see what the slots hold (the shards while
 * resharded): a module's full state is dp_fsdp_save_full_state_dict's.
 *
 * Errors: dp_module_grad or dp_module_set_grad of a parameter whose slot
 * holds its shard is DP_ESTATE naming it and its full shape (the unshard
 * protocol has the state errors of unshard, wait_unshard, reshard and
 * post_backward). A post_backward that finds a
 * gradient of another shape or dtype than the full parameter's (one set
 * past dp_module_set_grad) is DP_EINVAL naming it, and still reshards and
 * drops that gradient; with gradient sync it takes its reduce-scatter's
 * place, so the other ranks' dp_fsdp_finish_backward fails at once with
 * DP_EINVAL naming this rank, nothing is reduced, and every rank goes on
 * with the next iteration. So does a post_backward whose previous one
 * failed with no dp_fsdp_finish_backward reporting it (the message carries
 * that failure).
 * A rank whose peers skip an unshard it makes (or make another call in its
 * place) fails within the group's timeout: DP_EREMOTE naming both calls, or
 * DP_ETIMEOUT naming the ranks that had not issued it, after which the
 * dp_fsdp is unusable (DP_ESTATE). With init_sync, names, dtypes and shapes
 * are compared across ranks first and any difference (or one rank's
 * argument error: an option, the module, `out`, parameters over
 * overlapping memory; not `pg`) is DP_EINVAL on every rank naming the first
 * one, and the group stays usable.
 *
 * Thread safety: one dp_fsdp's calls are serialised (dp_fsdp_mark_grad_ready
 * may come from several threads at once); the host must not use the
 * module's managed parameters from another thread while unshard,
 * wait_unshard, reshard, post_backward or the mark that completes the set
 * swaps its slots, nor read a shard gradient before
 * dp_fsdp_finish_backward.
 *
 * Streams (GPUs): unshard and post_backward queue their work (the casts,
 * copies, the all-gather or reduce-scatter) on the NCCL group's stream,
 * after the host's current stream (dp_set_current_stream) as it was at the
 * call; an async unshard returns at once, as does post_backward except for
 * the wait before the full parameters' pages go (where they go: "Full
 * parameters keep one address", which reshard makes too). The host's stream
 * then waits for the full parameters (after a blocking unshard, wait_unshard,
 * reshard or post_backward) and for the shard gradients (after
 * finish_backward) through events; with no current stream set, those calls
 * wait on the host instead. A blocking call never waits for the all-gather
 * or reduce-scatter itself, nor for the host's stream: it waits for the job
 * to be queued, which takes the other ranks' calls (each collective's call
 * header, and the lane's agreement rounds, go between the ranks on a second
 * NCCL communicator with a stream of its own, never behind queued work). A
 * queued collective's deadline (the group's timeout) runs from the call, so
 * it includes the wait for the host's stream. One that fails later (a peer
 * gone, the deadline passed) aborts the communicator and breaks the group:
 * the device work queued after it runs on what the buffers hold, and the
 * call that waited for it on the host (no current stream set), or else the
 * next call on the group, fails naming the collective (DP_ESTATE).
 * dp_fsdp_destroy and the state-dict calls read the shards after the host's
 * stream, and the host's stream follows what they write. A full gradient
 * the host still holds after post_backward may be released at once: its
 * memory is reused (or, set with dp_module_set_grad over the host's own
 * memory, its deleter runs) only after the queued reduce-scatter has read
 * it. A dp_ddp on the same group still waits on the host for the host's
 * stream to reach each bucket's marks (its bucket copies), so a dp_fsdp
 * call queued behind a bucket on the lane waits for that too.
 *
 * Memory: on a shared-memory group, with init_sync, the shards live in
 * memory every rank of the group maps, where the other ranks' all-gathers
 * read them (dp_device_memory_stats counts it); a forked child that writes
 * a shard writes its parent's. Where that memory cannot be had (out of
 * memory, or past rank 0's file-size limit, RLIMIT_FSIZE) the shards stay
 * in each rank's own memory, on every rank alike, and views fall back to
 * copies (DP_DEBUG=INFO says why on stderr).
 *
 * Full parameters as views (opts->full_params_as_views = 1): on a
 * shared-memory group of two or more ranks, with init_sync and no
 * param_dtype that casts a sharded parameter, each parameter's shards lie
 * back to back in that memory, rank 0's rows first, so that the full
 * parameter is a view of every rank's shard. An unshard is then a barrier
 * (every rank has issued it, so the shard writes each made before are
 * done), no all-gather, and the full parameters take no memory; 0-d
 * parameters are still copies. Where these conditions do not hold the
 * option falls back to copies; after an unshard, dp_tensor_data of a full
 * parameter plus this rank's first row is dp_fsdp_shard's data exactly
 * when views are in use (for a shard that holds rows). In return the host must not write a full
 * parameter (the write would reach the shards of every rank), and must
 * write a shard (the optimizer, a state dict load) only while no rank has
 * its dp_fsdp unsharded or an unshard in flight: the usual loop does, since
 * dp_fsdp_finish_backward returns once every rank's post_backward (which
 * reshards) has been called, and another rank's next unshard waits for this
 * rank's. With gradient sync off, post_backward waits for nobody, so step
 * the optimizer after a synced backward only. A handle kept on a full
 * parameter after reshard sees later changes to the shards.
 * dp_fsdp_destroy and the state dicts copy, as without views.
 */
#ifndef DPARALLEL_DP_FSDP_H
#define DPARALLEL_DP_FSDP_H

#include "dparallel/dp_dist.h"
#include "dparallel/dp_module.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dp_fsdp dp_fsdp;

typedef struct dp_fsdp_options {
  size_t struct_size;        /* sizeof(dp_fsdp_options): set by DP_FSDP_OPTIONS_INIT */
  int reshard_after_forward; /* 1: ZeRO-3; 0: keep full parameters until post_backward */
  int32_t param_dtype;       /* -1: the parameters' own; a floating dtype to compute in */
  int32_t reduce_dtype;      /* -1: param_dtype; a floating dtype to reduce gradients in */
  int init_sync;             /* 1: rank 0's values and the agreement check before sharding */
  /* 1: where every rank maps the shards (a shared-memory group, init_sync,
   * no param_dtype cast), the full parameters are views of all the ranks'
   * shards: an unshard copies nothing and they take no memory, but the
   * host must only read them, and must write a shard only while no rank
   * has its dp_fsdp unsharded (see "Full parameters as views" above).
   * Elsewhere the full parameters are copies, as with 0 (the default). */
  int full_params_as_views;
} dp_fsdp_options;

#define DP_FSDP_OPTIONS_INIT \
  { sizeof(dp_fsdp_options), 1, -1, -1, 1, 0 }

/* Writes the defaults into the first `struct_size` bytes of `opts`. */
DP_API dp_status dp_fsdp_options_init(dp_fsdp_options *opts, size_t struct_size);
/* Collective when init_sync is set. A parameter a live dp_ddp manages is
 * DP_EINVAL naming it, and so are two parameters over overlapping memory
 * (naming both; handles over the same memory, dtype and shape are one tied
 * parameter). `opts` may be NULL (the defaults). */
DP_API dp_status dp_fsdp_create(dp_fsdp **out, dp_module *module, dp_process_group *pg,
                                const dp_fsdp_options *opts /* may be NULL */);
/* FSDP2's mesh argument (dp_dist.h's device meshes). A 1-D mesh: as
 * dp_fsdp_create over its group. A 2-D mesh: HSDP, the parameters sharded
 * over dimension 1's group (say the ranks of a host: "local" of
 * dp_device_mesh_create_by_host) and each shard replicated across dimension
 * 0's group ("host"): post_backward reduce-scatters the full gradients in
 * the shard group, then all-reduces the shard gradients across the
 * replicas, on a comm lane of the replicate group's, so that the all-reduce
 * overlaps the next reduce-scatters as they overlap the backward; the shard
 * gradients are the average over every rank of the mesh. With init_sync the
 * replicas are checked to agree too (names, shapes and shard layout; a
 * difference fails every rank's create naming it) and every rank starts
 * from rank 0's values. A sharded save is written by replica 0's shard
 * group alone and loads at any other mesh shape or world size; the full
 * save (over the shard group) is written by rank 0 of replica 0's shard
 * group. The mesh's groups are
 * held by the dp_fsdp: the mesh may be destroyed before it. More than 2
 * dimensions is DP_EINVAL naming 'mesh' (on every rank alike, nothing
 * sent). Everything else is as dp_fsdp_create. */
DP_API dp_status dp_fsdp_create_on_mesh(dp_fsdp **out, dp_module *module, const dp_device_mesh *mesh,
                                        const dp_fsdp_options *opts /* may be NULL */);
/* All-gather: the slots hold the full parameters (in param_dtype); with
 * `async` it returns once issued. States, repeats and errors of these three
 * calls: the unshard protocol above. */
DP_API dp_status dp_fsdp_unshard(dp_fsdp *fsdp, int async);
DP_API dp_status dp_fsdp_wait_unshard(dp_fsdp *fsdp);
/* The slots hold the shards again (ZeRO-2 keeps the full ones until post_backward). */
DP_API dp_status dp_fsdp_reshard(dp_fsdp *fsdp);
/* The full gradients are final: reshards, then reduce-scatters their average
 * into the shard gradients, asynchronously. */
DP_API dp_status dp_fsdp_post_backward(dp_fsdp *fsdp);
/* FSDP2's per-parameter post-accumulate hook, for a host whose autograd
 * tells when each gradient is final: marks managed parameter `name` (as
 * dp_fsdp_parameter_name gives it) ready in this backward. Any thread, in
 * any order, several at once. The mark that completes the set of managed
 * parameters that required grad at create runs dp_fsdp_post_backward
 * itself, on its own thread, before it returns (it queues the
 * reduce-scatter and returns, as the explicit call does; its error is this
 * mark's); the reduce-scatter follows every marking thread's current
 * stream. Then:
 * - dp_fsdp_post_backward for the same backward is a no-op (DP_OK), so a
 *   host may still end each backward with it, as FSDP2's final callback
 *   does; marks and the explicit call may mix: an explicit post_backward
 *   before the set is complete runs at once, reduces every gradient as it
 *   is (marked or not) and ends the backward's marks.
 * - dp_fsdp_finish_backward waits for it as usual. A finish_backward whose
 *   backward marked some parameters but not all is DP_ESTATE naming the
 *   unmarked ones: it stands in for the missing post_backward (reshards,
 *   drops this backward's full gradients, nothing reduced), so the other
 *   ranks' finish_backward fails with DP_EINVAL naming this rank, and
 *   every rank goes on with the next iteration.
 * Errors: an unknown name, or one of a parameter that did not require grad
 * at create, is DP_EINVAL naming it; a second mark of one parameter in a
 * backward (also after the set completed) is DP_ESTATE naming it; a mark
 * with no dp_fsdp_unshard since the last post_backward is DP_ESTATE. A
 * backward starts with the dp_fsdp's next unshard. */
DP_API dp_status dp_fsdp_mark_grad_ready(dp_fsdp *fsdp, const char *name);
/* Waits for the last post_backward's reduce-scatter. */
DP_API dp_status dp_fsdp_finish_backward(dp_fsdp *fsdp);
DP_API dp_status dp_fsdp_set_requires_gradient_sync(dp_fsdp *fsdp, int requires_sync);
/* The managed parameters, in the module's listing order; 0 for a NULL or
 * invalid handle. Names are relative to the module. */
DP_API size_t dp_fsdp_num_parameters(const dp_fsdp *fsdp);
DP_API dp_status dp_fsdp_parameter_name(const dp_fsdp *fsdp, size_t index,
                                        const char **out /* valid while fsdp lives */);
/* This rank's rows (a new handle on the shard itself: the optimizer updates
 * it in place), and their gradient, same shape and dtype. */
DP_API dp_status dp_fsdp_shard(const dp_fsdp *fsdp, size_t index, dp_tensor **out);
DP_API dp_status dp_fsdp_shard_grad(const dp_fsdp *fsdp, size_t index, dp_tensor **out);
/* Collective (every rank destroys its dp_fsdp of the pair): the module's
 * slots get the full parameters back, gathered in their own dtype, and the
 * parameters are free for another dp_fsdp or dp_ddp. When the gather fails
 * (a peer gone), the slots keep this rank's shards and dp_last_error says
 * why. A job that failed before (an unshard or post_backward the host did
 * not wait for) is reported in dp_last_error too, and the gather still
 * runs unless the dp_fsdp is unusable. NULL is accepted. */
DP_API void dp_fsdp_destroy(dp_fsdp *fsdp);

/* State dicts of a module whose parameters dp_fsdp hold (the root, say).
 *
 * Checkpoints never load wrong: every save is a transaction that succeeds on
 * every rank or fails on every rank (naming the rank that failed and why),
 * and a save that fails, or a rank that dies while saving, leaves the last
 * complete save at that path or in that folder as it was, loadable. Every
 * file carries checksums; a load refuses a damaged, partial or mixed save
 * before it changes anything.
 *
 * Full: collective over the ranks of `pg`, which every dp_fsdp holding a
 * parameter of `module` must be on (else DP_EINVAL naming the parameter):
 * each sharded parameter is gathered (one all-gather per dp_fsdp, in the
 * order their first parameters are listed) and rank 0 writes `path` as
 * dp_module_save would for the unsharded module: the same bytes, through a
 * temporary file flushed to disk and renamed over `path`. Rank 0's outcome
 * is every rank's: when its write fails, every rank gets its status, the
 * others' messages saying rank 0 could not write, and a file already at
 * `path` is as it was. Loading is local: every rank can read the file;
 * each keeps its rows of the sharded parameters and takes every other
 * tensor whole (`strict` and errors as for dp_module_load: without
 * `strict`, every tensor the file lacks, sharded or not, is left as it is;
 * the module is unchanged on an error found before copying, a damaged file
 * included). Every dp_fsdp involved must be resharded, with no unshard in
 * flight (DP_ESTATE otherwise). A NULL `path` on one rank takes the place
 * of its first collective: every rank's save fails with DP_EINVAL naming
 * that rank, and the group stays usable. */
DP_API dp_status dp_fsdp_save_full_state_dict(dp_module *module, dp_process_group *pg, const char *path);
DP_API dp_status dp_fsdp_load_full_state_dict(dp_module *module, const char *path, int strict);
/* The full state dict in memory: collective over `pg` as the full save is
 * (the same gathers, the same requirements and errors), and instead of the
 * file, *out on rank `root` (on every rank for -1) is a new module holding
 * what that file would: every tensor of the state dict under the same
 * dotted names, unsharded, in its own dtype, as a copy in cpu memory
 * (parameters as parameters with their requires_grad, persistent buffers as
 * buffers; child modules made for the dots); dp_module_save of it writes
 * the full save's bytes. *out is NULL on the other ranks. A `root` outside
 * -1..size-1 or a NULL `out` on one rank fails every rank's call with
 * DP_EINVAL naming it, as does a rank that cannot build the module (with
 * its status). */
DP_API dp_status dp_fsdp_full_state_dict(dp_module *module, dp_process_group *pg, int32_t root, dp_module **out);
/* Sharded: collective over `pg` (as for the full save). Each save gets an
 * id (16 hex digits, rank 0's); each rank writes
 * `folder`/shard-RRRRR-of-WWWWW-<id>.safetensors (the folder is made when
 * missing) holding its rows of every sharded parameter, with metadata
 * "dp.rows.<name>" = "first count rows" to re-shard them and "dp.save_id";
 * rank 0's file also holds every tensor that is not sharded. Once every
 * rank reported its file written, rank 0 writes `folder`/manifest.json,
 * last and atomically: the save's id, world size, every file with its size
 * and header checksum, and every tensor's row ranges with each piece's
 * CRC-32C. Only then is the save complete; rank 0 then removes the files
 * of earlier saves in the folder. A failure on any rank before that fails
 * the save on every rank (DP_EIO, DP_EINVAL, ... as the failing rank got
 * it, the others naming that rank), removes this save's files and leaves
 * the folder's last complete save as it was. When a rank dies after the
 * manifest may have been written, the others fail saying the outcome is
 * unknown and keep their files: the manifest decides. One save at a time
 * per folder.
 *
 * Loading is collective over the group of the dp_fsdp holding the module's
 * tensors (every rank calls it; local for a module no dp_fsdp holds). It
 * reads the manifest and checks every file against it: a folder without a
 * manifest is DP_EINVAL; a malformed manifest, a missing file, a file of
 * another save or world size, a size or header checksum that differs, row
 * ranges that overlap or leave rows in no file are DP_EIO naming the file
 * or the tensor. It then reads only the rows this rank keeps now and the
 * whole tensors, so a save at one world size loads at another, checking
 * each piece it reads against its checksum first (DP_EIO naming the file
 * and the tensor). Every key must name a tensor of the module and every
 * tensor must be covered, with the same dtype and full shape, else
 * DP_EINVAL naming each difference. A refusal on any rank is every rank's
 * (the others naming that rank), and the module is unchanged on every
 * rank; a read that fails after the checks (a file changed meanwhile) is
 * DP_EIO and may leave the module partly loaded, as dp_module_load. Every
 * dp_fsdp involved must be resharded, with no unshard in flight (DP_ESTATE
 * otherwise). */
DP_API dp_status dp_fsdp_save_sharded_state_dict(dp_module *module, dp_process_group *pg, const char *folder);
DP_API dp_status dp_fsdp_load_sharded_state_dict(dp_module *module, const char *folder);
/* The sharded save in the background (DCP's async_save): collective over
 * `pg` as the sharded save is (every rank calls it, in the same order as its
 * other saves on `pg`), it writes the same files and manifest, so
 * dp_fsdp_load_sharded_state_dict loads it as it loads a synchronous save.
 * - On the calling thread it copies this rank's part of the save (its rows
 *   of every sharded parameter; on rank 0 every other tensor too) into cpu
 *   memory of its own, after the host's work on its current stream (from
 *   device memory, a device-to-host copy ordered as the synchronous save's
 *   reads are), and returns; *out is then a new dp_work. What the host
 *   changes afterwards (the next optimizer step) is not saved.
 * - No collective runs on `pg`: a library thread writes the files, and the
 *   ranks agree through `pg`'s store under keys of the save's own (erased
 *   once every rank has read them), so the host keeps driving `pg`
 *   meanwhile. The manifest is written last, by rank 0, once every rank's
 *   file is written.
 * - dp_work_wait (or dp_work_test) reports the save's outcome, the same on
 *   every rank: a failure on any rank (a folder it cannot write, a full
 *   disk) fails every rank's work naming the lowest failing rank and its
 *   cause, removes this save's files and writes no manifest; a rank that
 *   dies or stops calling fails the others' work once `pg`'s timeout has
 *   passed without it, never hanging. The same timeout bounds each step of
 *   the agreement.
 * - Saves started on `pg` while one is in flight queue behind it: they are
 *   written one by one, in the order they were started, each from its own
 *   copy (so memory holds the copies of every queued save); saves on other
 *   groups are written beside them, on threads of their own. A synchronous
 *   save to the same folder must not overlap one in flight.
 * - The work owns everything the save needs: the module, its dp_fsdp and
 *   `pg` may be destroyed while it is in flight, and the save goes on. At
 *   process exit, a save in flight stops waiting for its peers (its work
 *   fails, and no manifest is written unless every rank's file was) and the
 *   queued ones fail unwritten; dp_shutdown leaves it running.
 * - Errors on the calling thread: `pg` NULL or not a group is DP_EINVAL on
 *   this rank alone. A NULL or invalid `module`, a NULL `folder` or `out`,
 *   and a module that cannot be saved so (its dp_fsdp on another group: as
 *   for the synchronous save; an HSDP module: DP_EUNSUPPORTED) fail this
 *   rank's call with that status naming the argument, and post the refusal
 *   as this rank's outcome: the other ranks' works fail naming this rank.
 *   `pg` must be a group made by dp_process_group_create (or from the
 *   environment, or split from one), which has a store: DP_ESTATE otherwise.
 * - Thread safety: as the synchronous save (the host's thread that drives
 *   `pg`). */
DP_API dp_status dp_fsdp_save_sharded_state_dict_async(dp_module *module, dp_process_group *pg, const char *folder,
                                                       dp_work **out);

#ifdef __cplusplus
}
#endif

#endif /* DPARALLEL_DP_FSDP_H */
