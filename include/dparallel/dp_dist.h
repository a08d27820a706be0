/* dparallel — collectives across processes and machines: stores, process
 * groups (for cpu tensors, shared memory between the ranks of one host and
 * Gloo across hosts; NCCL for cuda tensors) and their async work.
 *
 * Semantics follow PyTorch's c10d. Every rank of a group must issue the same
 * collectives in the same order with the same sizes; a mismatch is an error
 * on every rank (DP_EINVAL for sizes and arguments), never a hang or silent
 * corruption. Every blocking call honours the group's timeout: when a peer
 * dies or stops answering, the call fails with DP_ETIMEOUT or DP_EREMOTE,
 * naming the collective, the tensor and the ranks that did not arrive (or had
 * not reported the failure when this rank stopped listening for them), and
 * the group is then broken (later collectives fail with DP_ESTATE) but can
 * still be destroyed.
 *
 * A Gloo group sets SIGPIPE to be ignored when it is at its default action:
 * Gloo writes to sockets without MSG_NOSIGNAL, and a peer's death must fail
 * the collective rather than kill this process.
 *
 * Environment: DP_STORE_TOKEN (a job token the TCP store requires of every
 * client), DP_SOCKET_IFNAME (the network interface Gloo uses; default
 * loopback when the store is on a loopback address, else this host's name),
 * DP_STORE_ADDR and DP_STORE_PORT (where the default store is; see
 * dp_process_group_create_from_env), DP_SHM ("0": cpu groups that ask for
 * DP_BACKEND_AUTO use Gloo; otherwise an AUTO cpu group whose ranks all
 * run on one host uses shared memory,
 * through a segment private to the job: an anonymous memfd, no file in
 * /dev/shm or elsewhere; ranks on several hosts with the same number of
 * ranks, at least 2, on each are hierarchical: shared memory inside each
 * host and Gloo across, "shm+gloo"; uneven hosts use Gloo and rank 0 says
 * why on stderr. DP_BACKEND_GLOO and DP_BACKEND_SHM ignore it), DP_HOST_ID
 * (the host a rank counts as on, instead of the boot id and host name),
 * DP_CROSS_HOST ("mpi": such a hierarchical group's leg across hosts is MPI,
 * "shm+mpi", instead of Gloo; every rank must set the same, else DP_EINVAL
 * on every rank), DP_MPI_LIBRARY (the MPI library DP_BACKEND_MPI loads),
 * DP_TRACE_BUFFER (the flight recorder: how many of its last calls each
 * group keeps, with their sizes, state and times; default 2000, 0: none)
 * and DP_TRACE_DIR (where each rank writes them, rank<RANK>.json, when one
 * of its groups times out, a peer fails or the group is aborted, and on
 * SIGUSR1 if the host left that signal's action at its default; `dp-run
 * --diagnose DIR` names the rank behind and the first call that differs).
 * The job token guards the rendezvous (the store) only: the collectives'
 * own traffic, Gloo's and NCCL's connections, is not authenticated, so run
 * jobs on networks only they and trusted hosts can reach.
 *
 * Thread safety:
 * - dp_store: safe to use from any number of threads at once.
 * - dp_process_group: one group is driven by one thread at a time, in the
 *   same order on every rank; use one group per thread. Threads may take
 *   turns (a call made once the previous thread's calls, async ones
 *   included, have finished), and one thread may mix async and blocking
 *   calls, which run in the order made. A call made while another thread's
 *   call on the group is in flight (running or queued) is DP_ESTATE naming
 *   that call; since the ranks may then have paired one thread's call with
 *   another's, the call in flight fails with DP_ESTATE too, and every later
 *   call on the group is DP_ESTATE on this rank and fails the other ranks'
 *   matching call at once (DP_EINVAL naming this rank): make a new group.
 *   Destroying a group while another thread uses that same handle is the
 *   caller's to prevent. A dp_ddp's collectives run on a library thread of
 *   their own: while a dp_ddp on the group is in a backward, the host's
 *   calls on the group are DP_ESTATE at once, nothing sent (dp_ddp.h).
 * - dp_work: one thread at a time per handle.
 * - dp_device_mesh: its queries (ndim, shape, coordinate, dim_name, group)
 *   from any number of threads at once; each dimension's group is a
 *   dp_process_group of its own, driven as above (one thread per group:
 *   the groups of different dimensions may be driven by different
 *   threads). Creating a mesh or splitting a group drives the parent group.
 *
 * Processes: a store, group, work or mesh belongs to the process that
 * created it. In a forked child every call on an inherited one is DP_ESTATE ("this
 * is a forked child"), without a byte on the parent's connections or shared
 * memory, and destroying it there frees nothing and touches nothing the
 * parent uses; the child makes its own.
 */
#ifndef DPARALLEL_DP_DIST_H
#define DPARALLEL_DP_DIST_H

#include "dparallel/dp_base.h"
#include "dparallel/dp_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- stores: the contract of c10d's stores ---- */
typedef struct dp_store dp_store;

/* A store in the file at `path` on a filesystem every rank sees, with the
 * semantics of PyTorch's FileStore: the last set of a key wins and every
 * handle on the file sees it. `path` must be a regular file or not exist
 * yet (anything else, a FIFO say, is DP_EINVAL naming the path; it is
 * never opened in a way that could block). The last of `world_size` users
 * to destroy it removes the file. Its default timeout of get and wait is
 * 300000 ms (see dp_store_set_timeout); it also bounds the wait for the
 * file's lock (held by a stopped process, say): DP_ETIMEOUT naming the path. */
DP_API dp_status dp_store_create_file(dp_store **out, const char *path, int32_t world_size);
/* A TCP store. With `is_server`, this process serves it on `host`:`port`
 * (bound to that address only; port 0 picks a free one, see
 * dp_store_tcp_port) and is also a client. Clients connect, retrying until
 * `timeout_ms`, which also bounds each request and is the default timeout
 * of get and wait.
 *
 * `world_size` (>= 1) is the number of workers, as in PyTorch's TCPStore
 * with wait_for_workers: every handle created here counts as one worker,
 * the server's included, and the server's create returns only once
 * `world_size` of them have connected: DP_ETIMEOUT (saying how many did)
 * after `timeout_ms`. So create the server with world_size 1 when the
 * clients are created after it in the same thread. Keys starting with
 * "__dp_store/" are the store's own.
 *
 * Keys are at most 4096 bytes, values at most 64 MiB, and a wait takes at
 * most 4096 keys: more is DP_EINVAL naming the limit, before anything is
 * sent. get and wait are held by the server until the keys exist or the
 * call's timeout passes; the caller waits at most its own timeout plus a
 * tenth of it (0.1 to 1 s) for the server's answer, whatever the store's
 * timeout.
 *
 * With DP_STORE_TOKEN set, the server refuses clients whose DP_STORE_TOKEN
 * differs: their create fails with DP_EREMOTE. The greeting (HMAC-SHA256
 * over fresh nonces) proves the token both ways without sending it: a
 * client also refuses (DP_EREMOTE) a server that cannot prove it knows the
 * token. Without a token, anyone who can reach the port can use the store.
 *
 * Limits per connection that keep one client, or many, from taking the
 * server down; each closes only that client's connection. Malformed or
 * oversized messages; no greeting within 10 s; replies left unread for 5 s;
 * a request not arrived whole 30 s after its first byte. A client's
 * requests are not read while more than 1 MiB of replies waits for it, so
 * its pending output stays under 1 MiB plus one reply, and its buffered
 * input under one request. Past 64 connections that have not greeted, the
 * oldest of them is closed; past 1024 connections, the greeted one idle the
 * longest (none of its requests pending) is closed to let the new one in,
 * and its handle reconnects on its next call. Refused and closed clients
 * are logged to stderr, at most 20 lines per 10 s (then a count). */
DP_API dp_status dp_store_create_tcp(dp_store **out, const char *host, uint16_t port, int32_t world_size, int is_server,
                                     int32_t timeout_ms);
DP_API dp_status dp_store_set(dp_store *store, const char *key, const void *value, size_t len);
/* Waits up to the store's timeout for `key`, then copies its value into
 * `buf` and its length into `*len_out`. With buf NULL and cap 0 it only
 * reports the length; a `cap` smaller than the value is DP_EINVAL (the
 * message gives the length). */
DP_API dp_status dp_store_get(dp_store *store, const char *key, void *buf, size_t cap, size_t *len_out);
/* Adds `delta` to the integer at `key` (0 when absent); `out` (may be NULL)
 * receives the new value. */
DP_API dp_status dp_store_add(dp_store *store, const char *key, int64_t delta, int64_t *out);
/* Waits until every key exists: DP_ETIMEOUT (naming the missing keys) after
 * `timeout_ms`; a negative timeout_ms means the store's timeout. */
DP_API dp_status dp_store_wait(dp_store *store, const char *const *keys, size_t nkeys, int32_t timeout_ms);
DP_API void dp_store_destroy(dp_store *store);

/* ---- process groups ---- */
/* The backend a group asks for; dp_process_group_backend says what runs.
 * Every rank must ask for the same one (else DP_EINVAL on every rank).
 * AUTO: NCCL for cuda; for cpu, shared memory when every rank runs on one
 *   host, "shm+gloo" across hosts with the same number of ranks (at least
 *   2) on each, else Gloo (DP_SHM=0 on any rank: always Gloo). On one host,
 *   where rank 0 finds no room for the shared memory (out of memory, or past
 *   its file-size limit, RLIMIT_FSIZE), every rank uses Gloo and rank 0
 *   says why on stderr; SHM then fails with DP_ENOMEM on every rank.
 * GLOO: Gloo for cpu, even when every rank runs on one host.
 * NCCL: NCCL for cuda.
 * SHM: shared memory for cpu; DP_EUNSUPPORTED naming the hosts when the
 *   ranks span several (every rank fails alike).
 * MPI: the site's MPI for cpu, loaded at run time (DP_MPI_LIBRARY, else
 *   libmpi.so.40 (Open MPI), libmpi.so.12 or libmpich.so.12 (MPICH), the
 *   launcher's first); the ranks must be processes of one MPI job (mpirun),
 *   else DP_EUNSUPPORTED on every rank; DP_EUNSUPPORTED too when no MPI
 *   library loads. MPI initialised by the host is used when its thread level
 *   is MPI_THREAD_MULTIPLE or _SERIALIZED; otherwise dparallel initialises
 *   it and finalises it at exit or at dp_shutdown with no MPI group left. A
 *   process that never asks for MPI never loads it. */
typedef enum dp_backend {
  DP_BACKEND_AUTO = 0,
  DP_BACKEND_GLOO = 1,
  DP_BACKEND_NCCL = 2,
  DP_BACKEND_SHM = 3,
  DP_BACKEND_MPI = 4
} dp_backend;
typedef enum dp_reduce_op { DP_SUM = 0, DP_AVG = 1, DP_MIN = 2, DP_MAX = 3, DP_PROD = 4 } dp_reduce_op;
typedef struct dp_process_group_options {
  size_t struct_size;
  int32_t backend;    /* dp_backend (above); default AUTO */
  int32_t rank;       /* -1 (the default): the launcher's (see dp_process_group_create_from_env) */
  int32_t world_size; /* -1 (the default): the launcher's */
  dp_store *store;    /* NULL: a TCP store served by rank 0 (see dp_process_group_create_from_env) */
  int32_t timeout_ms; /* default 300000 */
  dp_device device;   /* the device this rank's tensors live on */
} dp_process_group_options;
#define DP_PROCESS_GROUP_OPTIONS_INIT                                                             \
  {                                                                                               \
    sizeof(dp_process_group_options), DP_BACKEND_AUTO, -1, -1, NULL, 300000, { DP_DEVICE_CPU, 0 } \
  }
/* Fills the caller's struct with the defaults above, writing exactly
 * `struct_size` bytes: pass sizeof(dp_process_group_options) as your header
 * declares it. A host built against an older header gets only the fields it
 * has; one with a newer header gets the fields this library knows and zeros
 * after them. opts->struct_size becomes `struct_size`, so the create calls
 * read only what the caller has. DP_EINVAL for a struct_size below
 * sizeof(size_t) or one that ends inside a field (no header's size); every
 * call that takes a struct with struct_size refuses those alike. */
DP_API dp_status dp_process_group_options_init(dp_process_group_options *opts, size_t struct_size);
typedef struct dp_process_group dp_process_group;
/* Joins the group: every rank calls it with the same world size and store.
 * The group holds its own reference to the store. The options' rank and
 * world size win; only those left -1 are read from the launcher's variables
 * (the rank's and the world size's, as dp_process_group_create_from_env
 * finds them; the local rank is never needed). With a NULL store, the
 * store's address is read as there too. A missing variable is DP_EINVAL
 * naming it. */
DP_API dp_status dp_process_group_create(dp_process_group **out, const dp_process_group_options *opts);
/* As dp_process_group_create, with rank and world size (and the local rank,
 * checked but unused) from the first launcher whose rank or world-size
 * variable is set, in this order:
 *   torchrun, dp-run: RANK, WORLD_SIZE, LOCAL_RANK;
 *   Open MPI's mpirun: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK;
 *   MPICH's and Intel MPI's mpiexec: PMI_RANK, PMI_SIZE, and MPI_LOCALRANKID
 *     when set;
 *   Slurm's srun: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID.
 * With a NULL opts->store, rank 0 serves a TCP store that every rank
 * connects to (each of the two on its own):
 *   host: DP_STORE_ADDR, else MASTER_ADDR, else under Slurm the first host
 *     of SLURM_STEP_NODELIST, else of SLURM_JOB_NODELIST ("node[003-005],gpu7"
 *     is node003; where Slurm starts task 0 by default);
 *   port: DP_STORE_PORT, else MASTER_PORT, else under Slurm 20000 +
 *     (SLURM_JOB_ID + SLURM_STEP_ID) % 10000, below Linux's ephemeral ports.
 *     Two jobs (or steps) whose rank 0 shares a host collide there when
 *     their sums agree modulo 10000, as does anything else on that port:
 *     set DP_STORE_PORT (or MASTER_PORT) to choose one.
 * "Under Slurm": srun's variables were found, or the launcher's rank and
 * world size are SLURM_PROCID's and SLURM_NTASKS's (srun --mpi=pmi2 sets
 * PMI_RANK and PMI_SIZE too); mpirun's ranks in an allocation need
 * MASTER_ADDR and MASTER_PORT.
 * dp-run sets DP_STORE_ADDR and DP_STORE_PORT for dparallel's store and
 * leaves MASTER_PORT, another port, to the program's own framework (such as
 * torch.distributed's env://), which would otherwise collide with it. Set
 * by hand, MASTER_ADDR and MASTER_PORT alone serve dparallel as before.
 * A variable set but empty counts as unset when choosing among these; one
 * that is needed and missing, empty, malformed or out of range (a rank not
 * below the world size, a malformed node list) is DP_EINVAL naming it. With
 * DP_DEBUG=INFO or DETAIL, this and dp_process_group_create say in one line
 * on stderr which variables gave the rank, the world size and the store's
 * address, before connecting to the store. */
DP_API dp_status dp_process_group_create_from_env(dp_process_group **out,
                                                  const dp_process_group_options *opts /* may be NULL */);
/* -1 (and dp_last_error set) for a NULL or invalid handle. */
DP_API int32_t dp_process_group_rank(const dp_process_group *pg);
DP_API int32_t dp_process_group_size(const dp_process_group *pg);
/* Waits for this handle's queued collectives (each bounded by the timeout),
 * then leaves the group; NULL is accepted. */
DP_API void dp_process_group_destroy(dp_process_group *pg);

/* ---- collectives: in place; every rank passes tensors of equal sizes ---- */
/* Tensors live on the group's device, cpu:i or cuda:i (DP_EINVAL naming the
 * argument when not). Sizes, dtypes, ops or roots that differ across ranks
 * are DP_EINVAL on every rank and the group stays usable; a rank out of step
 * (another collective) is DP_EREMOTE and breaks the group.
 * A call that a rank refuses for a bad argument (a NULL or wrong tensor, op,
 * root or count: anything but the group handle itself) still takes its place
 * in the sequence: the matching call on every other rank fails at
 * once with DP_EINVAL naming the refusing rank and its reason, and the group
 * stays usable. A refused synchronous call returns once every rank has seen
 * the refusal; a refused _async call returns DP_EINVAL at once. */
typedef struct dp_work dp_work;
/* DP_AVG divides the sum by the world size (integers truncate; not for bool);
 * NCCL scales floats by 1/size instead, so results may differ from Gloo's in
 * the last bit. On bool tensors SUM and MAX are logical or, PROD and MIN
 * logical and. */
DP_API dp_status dp_pg_all_reduce(dp_process_group *pg, dp_tensor *tensor, int32_t op);
DP_API dp_status dp_pg_all_reduce_async(dp_process_group *pg, dp_tensor *tensor, int32_t op, dp_work **out);
DP_API dp_status dp_pg_broadcast(dp_process_group *pg, dp_tensor *tensor, int32_t root);
/* outputs[r] receives rank r's input; each has the input's dtype and numel. */
DP_API dp_status dp_pg_all_gather(dp_process_group *pg, const dp_tensor *input, dp_tensor *const *outputs,
                                  size_t noutputs /* = world size */);
/* output = reduction over ranks of their inputs[this rank]. */
DP_API dp_status dp_pg_reduce_scatter(dp_process_group *pg, const dp_tensor *const *inputs,
                                      size_t ninputs /* = world size */, dp_tensor *output, int32_t op);
DP_API dp_status dp_pg_barrier(dp_process_group *pg);
/* The collective's status (and message) once it has finished. An _async
 * call starts after the work queued so far on the calling thread's current
 * stream, as every call does, but its results are ordered only by this wait
 * (or dp_work_test saying done), as with PyTorch's async_op: work the host
 * queues on a stream before then may see them unfinished. */
DP_API dp_status dp_work_wait(dp_work *work);
/* *done = 1 once finished (then dp_work_wait returns at once), else 0. */
DP_API dp_status dp_work_test(dp_work *work, int *done);
/* Drops the handle; the collective still completes. NULL is accepted. */
DP_API void dp_work_destroy(dp_work *work);

/* Additions beyond the base contract. */

/* The port a TCP store serves or is connected to (the free port picked
 * when it was created with port 0). DP_EINVAL for a file store. */
DP_API dp_status dp_store_tcp_port(const dp_store *store, uint16_t *out);
/* Sets the default timeout of get and wait (and of each TCP request). */
DP_API dp_status dp_store_set_timeout(dp_store *store, int32_t timeout_ms);
DP_API dp_status dp_pg_broadcast_async(dp_process_group *pg, dp_tensor *tensor, int32_t root, dp_work **out);
DP_API dp_status dp_pg_all_gather_async(dp_process_group *pg, const dp_tensor *input, dp_tensor *const *outputs,
                                        size_t noutputs, dp_work **out);
DP_API dp_status dp_pg_reduce_scatter_async(dp_process_group *pg, const dp_tensor *const *inputs, size_t ninputs,
                                            dp_tensor *output, int32_t op, dp_work **out);
DP_API dp_status dp_pg_barrier_async(dp_process_group *pg, dp_work **out);
/* "shm", "shm+gloo", "gloo" or "nccl" (static text); NULL for an invalid handle. */
DP_API const char *dp_process_group_backend(const dp_process_group *pg);

/* ---- subgroups (c10d's split_group, MPI_Comm_split) ---- */
/* A collective over `pg`: every rank of pg calls it, in its place among
 * pg's other collectives (it runs as one all_gather of pg, so a rank that
 * calls another collective meanwhile fails as out of step, on every rank).
 * The ranks passing the same `color` >= 0 form a new group, *out, ranked by
 * (`key`, rank in pg): equal keys keep pg's order. A negative color joins
 * none: *out = NULL and DP_OK, after taking part in the exchange. The new
 * groups are made through pg's store, under keys of their own (no new store
 * is needed), and choose their backend as any group does (DP_BACKEND_AUTO:
 * shared memory when all its ranks run on one host, and so on).
 * `opts` NULL: pg's timeout and device, DP_BACKEND_AUTO; otherwise its
 * backend, timeout_ms and device are used (its rank, world_size and store
 * are ignored). A bad argument past `pg` (NULL out, a bad opts) refuses the
 * exchange: the other ranks' split fails at once naming this rank (DP_EINVAL)
 * and pg stays usable. The new group holds its own reference to pg's store
 * and keeps working after pg is destroyed, as long as the store's server
 * runs (with the default store: rank 0's process of pg's job). A new
 * group's own collectives are independent of pg's: a thread may drive each. */
DP_API dp_status dp_process_group_split(dp_process_group *pg, int32_t color, int32_t key,
                                        const dp_process_group_options *opts /* may be NULL */, dp_process_group **out);
/* The hosts of a group, as its creation learnt them (no communication):
 * ranks count as on one host when their host keys match (DP_HOST_ID when
 * set, else the boot id and host name, in the same network and pid
 * namespaces). local_rank: this rank's index among the group's ranks on its
 * host, in rank order; local_size: how many of the group's ranks run on
 * this host; num_hosts: how many hosts the group spans. -1 (and
 * dp_last_error set) for a NULL or invalid handle. */
DP_API int32_t dp_process_group_local_rank(const dp_process_group *pg);
DP_API int32_t dp_process_group_local_size(const dp_process_group *pg);
DP_API int32_t dp_process_group_num_hosts(const dp_process_group *pg);

/* Aborts the group, from any thread, also while another thread's call on
 * it runs. Every later call fails at once with DP_ESTATE saying the group
 * was aborted, and the peers' current or next collective with it fails
 * instead of waiting for its timeout (Gloo closes its connections, shared
 * memory flags the group, the hierarchical backend does both, NCCL aborts
 * its communicators, MPI stops polling). A call running on this rank fails
 * the same way at once on shared memory, NCCL and MPI, but on Gloo only at
 * its deadline: Gloo's waits cannot be interrupted (its running call may
 * also fail sooner, when a peer's failure reaches it). A call may have
 * completed just before the abort; on shared memory a peer's call that the
 * interrupted call had already joined may complete too, and the peer's
 * next one fails. The group stays unusable and is still destroyed with
 * dp_process_group_destroy (not concurrently with this call). With
 * DP_TRACE_DIR set the rank writes its flight recorder (above). DP_EINVAL
 * for an invalid pg. */
DP_API dp_status dp_process_group_abort(dp_process_group *pg);

/* After a peer's failure, the ranks still alive go on without it: every
 * survivor calls shrink on the group (usually broken by the failure; it is
 * not used). They agree through the group's store, within twice the group's
 * timeout, on who is left, and each gets in *out a new group of the
 * survivors in their old order (ranks renumbered from 0), over the same
 * backend choice, device and timeout; on NCCL a new communicator. A rank
 * counts as lost as soon as its connection to the job's TCP store closed
 * (its process died, or left: seen at once, on any host), or when it has
 * not called shrink within twice the timeout (a hung process, a host cut
 * off, a process whose store connection the server closed to make room
 * for more than 1024 clients, or any store other than the TCP store). The
 * first rank to see every rank alive or lost, or to reach that deadline,
 * decides for all through the store, so every survivor gets the same
 * group. A rank that saw no other rank, alive or lost, forms no group: it
 * fails (DP_ETIMEOUT) and withdraws, since it cannot tell the others'
 * failure from its own. On success dp_last_error names the ranks left out
 * (dp_process_group_lost_ranks lists them). Errors: DP_ESTATE for a rank
 * the decision left out (it called shrink too late); DP_EREMOTE or
 * DP_ETIMEOUT when the store itself is lost (its host, rank 0's under
 * dp-run, died): that failure cannot be survived, and neither can a
 * shrink whose survivors no longer hold data only a lost rank had. pg is
 * left as it was; destroy it. Not thread-safe with other calls of shrink
 * on pg; each survivor calls it once per failure. */
DP_API dp_status dp_process_group_shrink(dp_process_group *pg, dp_process_group **out);
/* The ranks of pg (pg's numbering) that its last shrink left out, or for a
 * group made by a shrink those the shrink left out of the group it came
 * from: writes up to `cap` of them to `ranks` (NULL with cap 0 to ask how
 * many) and returns how many there are; 0 for a group never shrunk; -1 for
 * an invalid pg or a NULL ranks with cap > 0 (dp_last_error says). Any
 * thread. */
DP_API int32_t dp_process_group_lost_ranks(const dp_process_group *pg, int32_t *ranks, size_t cap);

/* ---- device meshes (PyTorch's init_device_mesh) ---- */
/* The ranks of a group laid out as an n-dimensional array, with one group
 * per dimension: the ranks that differ only in their coordinate along it,
 * ranked by that coordinate. Each is a new group made by
 * dp_process_group_split (one split of pg per dimension, in dimension
 * order), a normal group that dp_ddp and dp_fsdp run on. Creating a mesh is
 * a collective over pg; a bad argument past `pg` refuses the first split
 * (the other ranks fail at once naming this rank). The mesh does not need
 * pg afterwards. */
typedef struct dp_device_mesh dp_device_mesh;
/* pg's ranks row-major over `shape` (`ndim` >= 1 extents, each > 0, their
 * product the world size: else DP_EINVAL naming 'shape' with both numbers).
 * `dim_names`: ndim distinct non-empty names, or NULL for "dim0", "dim1",
 * ... (copied). */
DP_API dp_status dp_device_mesh_create(dp_device_mesh **out, dp_process_group *pg, const int32_t *shape, size_t ndim,
                                       const char *const *dim_names /* may be NULL */);
/* The 2-D mesh ("host", "local") of pg's hosts: coordinate (host index,
 * local rank), hosts numbered in the order of their lowest rank. "local"
 * joins this rank's host (shared memory under AUTO), "host" the ranks of
 * this local rank on every host. DP_EINVAL naming the counts when the
 * hosts run different numbers of pg's ranks. */
DP_API dp_status dp_device_mesh_create_by_host(dp_device_mesh **out, dp_process_group *pg);
/* The number of dimensions; 0 (and dp_last_error set) for an invalid handle. */
DP_API size_t dp_device_mesh_ndim(const dp_device_mesh *mesh);
/* The group of the dimension `dim_name` (DP_EINVAL naming it and listing
 * the mesh's names when there is none). *out is borrowed: it lives as long
 * as the mesh; dp_process_group_destroy on it is refused (nothing freed). */
DP_API dp_status dp_device_mesh_group(const dp_device_mesh *mesh, const char *dim_name, dp_process_group **out);
/* Leaves the mesh's groups (as dp_process_group_destroy); NULL is accepted. */
DP_API void dp_device_mesh_destroy(dp_device_mesh *mesh);
/* Writes the ndim extents of the mesh; `cap` must be at least ndim. */
DP_API dp_status dp_device_mesh_shape(const dp_device_mesh *mesh, int32_t *out, size_t cap);
/* Writes this rank's ndim coordinates in the mesh (its rank in each
 * dimension's group); `cap` must be at least ndim. */
DP_API dp_status dp_device_mesh_coordinate(const dp_device_mesh *mesh, int32_t *out, size_t cap);
/* The name of dimension `dim` (< ndim); *out lives as long as the mesh. */
DP_API dp_status dp_device_mesh_dim_name(const dp_device_mesh *mesh, size_t dim, const char **out);

#ifdef __cplusplus
}
#endif

#endif /* DPARALLEL_DP_DIST_H */
