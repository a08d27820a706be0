/* dparallel — modules: trees of named parameters, buffers and child modules.
 *
 * A module is what a host framework registers so that dparallel can replicate
 * it, reduce its gradients and save it. Names are dotted and listed in
 * registration order the way torch.nn.Module's named_parameters() lists them:
 * a module's own parameters, then each child's, depth first ("fc1.weight",
 * "fc1.bias", "fc2.weight", ...). A child or tensor registered in two places
 * (shared, tied) is listed once, under its first name, and a tensor
 * registered as a parameter twice is one parameter with one gradient. A slot
 * registered as NULL is kept (and replicated) but never listed.
 *
 * Tensors are held by reference: a dp_tensor that comes out of a module
 * shares its storage, so a host writes parameters and gradients in place.
 *
 * Thread safety: any number of threads may read one module tree at once
 * (counts, *_at, get_*, save, replication), and dp_module_grad may be called
 * concurrently. Registering into a tree, loading into it or zero_grad while
 * another thread uses the same tree is the caller's to prevent.
 */
#ifndef DPARALLEL_DP_MODULE_H
#define DPARALLEL_DP_MODULE_H

#include "dparallel/dp_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct dp_module dp_module;

/* A new, empty module. */
DP_API dp_status dp_module_create(dp_module **out);
/* Drops this reference; NULL is accepted. The tree lives while any handle to
 * it or to a module holding it lives. Tearing a tree down does not recurse,
 * however deep it is. */
DP_API void dp_module_destroy(dp_module *module);
/* `name` is non-empty valid UTF-8 (checkpoint headers are JSON), holds no
 * '.', and is not yet used in this module by a parameter, buffer or child;
 * else DP_EINVAL naming 'name'. The same rules hold for the next two.
 * `value` may be NULL (the slot stays NULL). */
DP_API dp_status dp_module_register_parameter(dp_module *module, const char *name, dp_tensor *value /* may be NULL */,
                                              int requires_grad);
/* A non-persistent buffer is replicated but not part of the state dict. */
DP_API dp_status dp_module_register_buffer(dp_module *module, const char *name, dp_tensor *value /* may be NULL */,
                                           int persistent);
/* `child` may be NULL; a child that contains `module` (a cycle) is DP_EINVAL.
 * Trees of any depth can be built, but walks over a tree (counts, *_at,
 * save, load, replication) refuse one deeper than 1024 levels below the
 * module they start from with DP_EINVAL: dotted names grow with depth. */
DP_API dp_status dp_module_register_module(dp_module *module, const char *name, dp_module *child);
/* Recursive counts, each shared tensor once; 0 for a NULL or invalid handle. */
DP_API size_t dp_module_num_parameters(const dp_module *module);
DP_API size_t dp_module_num_buffers(const dp_module *module);
/* The index-th parameter (buffer) in listing order. `name_out` (may be NULL)
 * receives its dotted name, valid while `module` lives. */
DP_API dp_status dp_module_parameter_at(const dp_module *module, size_t index,
                                        const char **name_out /* valid while module lives */, dp_tensor **out);
DP_API dp_status dp_module_buffer_at(const dp_module *module, size_t index, const char **name_out, dp_tensor **out);
/* Lookups by dotted name, any path to a shared child included. An unknown name
 * is DP_EINVAL with the name in the message; a NULL slot gives DP_OK and *out
 * NULL. dp_module_get_module("") is the module itself. */
DP_API dp_status dp_module_get_parameter(const dp_module *module, const char *dotted_name, dp_tensor **out);
DP_API dp_status dp_module_get_buffer(const dp_module *module, const char *dotted_name, dp_tensor **out);
DP_API dp_status dp_module_get_module(const dp_module *module, const char *dotted_name, dp_module **out);
/* The parameter's gradient: same dtype, shape and device, allocated zeroed on
 * first use, then the same storage until it is set again. The handle follows
 * the gradient: when its storage moves (dp_module_set_grad, or a dp_ddp with
 * gradient_as_bucket_view at create and at its one rebuild), each later call
 * through this handle uses the new storage; a pointer taken earlier from
 * dp_tensor_data does not follow. */
DP_API dp_status dp_module_grad(dp_module *module, const char *dotted_name, dp_tensor **out);
/* Makes `grad` the parameter's gradient: memory the host owns (e.g.
 * dp_tensor_from_blob over its autograd's gradient buffer), with the
 * parameter's dtype, shape and device (else DP_EINVAL naming 'grad'). A new
 * reference is taken; NULL drops the gradient (the next dp_module_grad
 * allocates zeros). A dp_ddp reads and writes it in place, with no copy of
 * its own beyond the bucket; with gradient_as_bucket_view, a gradient set
 * after dp_ddp_create is copied into its bucket slot and back instead of
 * being a view, and the next create or rebuild replaces it by a view. Set
 * it between backwards, not while a dp_ddp's backward is in flight. A
 * parameter a dp_fsdp shards takes its full gradient (the full parameter's
 * dtype and shape) only while unsharded: while its slot holds this rank's
 * shard, setting one is DP_ESTATE saying so (dropping it with NULL is not). */
DP_API dp_status dp_module_set_grad(dp_module *module, const char *dotted_name, dp_tensor *grad);
/* Fills every allocated gradient with zeros (the storage is kept). */
DP_API dp_status dp_module_zero_grad(dp_module *module);
/* The state dict (parameters and persistent buffers, each tensor once) as a
 * safetensors file with metadata {"format": "pt"} and "dp.crc32c" (the
 * CRC-32C of the data section, eight lowercase hex digits), written to a new
 * temporary file (".dp-save-" and six random characters, removed on failure)
 * in the folder of the file it replaces, flushed to disk (fsync), then
 * renamed over that file: `path` holds the old file or the whole new one,
 * never a part, even across a crash. Concurrent saves never share a
 * temporary file and a name up to NAME_MAX can be saved. Saving the same
 * state twice gives the same bytes.
 * - A symbolic link `path` is kept: the file it (finally) names is replaced,
 *   or created when it does not exist.
 * - An existing file keeps its permission bits; a new one gets 0666 & ~umask.
 * - An existing file that is read-only (no write permission bit) or that this
 *   user cannot write is not replaced: DP_EIO naming it, with the system's
 *   reason. (Checked before writing; a file changed meanwhile is not.)
 * - An existing `path` that is not a regular file (a directory, a FIFO, a
 *   device) is DP_EINVAL naming it.
 * - A module tree deeper than 1024 levels is DP_EINVAL (as for every walk:
 *   counts, *_at, replication); destroying one works at any depth.
 * DP_EIO with the system's reason on an I/O failure. */
DP_API dp_status dp_module_save(const dp_module *module, const char *path);
/* Copies a safetensors file into the module's tensors; a key may name any
 * path to a tensor. A `path` that is not a regular file (checked without
 * opening a FIFO for reading, so never blocking) is DP_EINVAL naming it. A
 * malformed file (truncated, bad header length, bad JSON, a key twice at any
 * level, unknown dtype, overlapping or out-of-range offsets) is DP_EIO, and
 * so is one whose data differs from its "dp.crc32c" checksum (read whole and
 * checked before any tensor changes; files of other writers, without one,
 * load unchecked). With `strict`, missing and unexpected keys are DP_EINVAL
 * naming all of them; without it, tensors the file lacks are left as they
 * are. A shape or dtype mismatch always is DP_EINVAL, naming the key and
 * both shapes. Checking
 * the header takes time linear in its size. The header is checked against
 * the file's size before any tensor data is read, and the data is read
 * straight into the tensors (no second copy of the file in memory). On any
 * failure the module is unchanged, except for a read error while copying
 * (the file shrank or failed during the load): DP_EIO, possibly partly
 * loaded. */
DP_API dp_status dp_module_load(dp_module *module, const char *path, int strict);

/* Additions beyond the base contract. */

/* Sets whether a parameter or buffer requires grad (replication keeps it,
 * unless detached; gradients are reduced only for parameters that do). */
DP_API dp_status dp_module_set_requires_grad(dp_module *module, const char *dotted_name, int requires_grad);
DP_API dp_status dp_module_requires_grad(const dp_module *module, const char *dotted_name, int *out);

#ifdef __cplusplus
}
#endif

#endif /* DPARALLEL_DP_MODULE_H */
