// dparallel's SWIG layer: fully_shard (sharded data parallel) and its
// state dicts.
#ifndef DPARALLEL_BINDINGS_SWIG_FSDP_HPP
#define DPARALLEL_BINDINGS_SWIG_FSDP_HPP

#include "dpswig_dist.hpp"
#include "dpswig_module.hpp"

namespace dpswig {

struct FsdpOptions {
  // true (ZeRO-3): reshard() frees the full parameters; false (ZeRO-2): they
  // stay until postBackward.
  bool reshardAfterForward = true;
  // -1: the parameters' own dtype; else the dtype to compute in.
  int paramDtype = -1;
  // -1: paramDtype; else the dtype to reduce gradients in.
  int reduceDtype = -1;
  // Rank 0's values and the agreement check before sharding.
  bool initSync = true;
  // On a shared-memory group of two or more ranks, with initSync, the full
  // parameters are views of every rank's shards (an unshard copies
  // nothing): a write to a full parameter reaches every rank's shard, and
  // shards may be written only while no rank has the Fsdp unsharded (after
  // finishBackward, say). Elsewhere, or with a paramDtype cast, they stay
  // copies.
  bool fullParamsAsViews = false;
};

// Each rank keeps only its rows of every parameter of `module` that no live
// Fsdp holds (create the children's first). Every call that moves data is
// collective: every rank makes it, in the same order. close() is
// collective too: the module's slots get the full parameters back. Each
// full parameter keeps one address from the first unshard to close(): a
// tensor taken while unsharded sees every later unshard's values, and reads
// zeros while resharded on the CPU (its pages are given back; dp_fsdp.h).
class Fsdp {
 public:
  Fsdp(Module& module, ProcessGroup& pg, const FsdpOptions& options = FsdpOptions()) {
    const dp_fsdp_options o = raw(options);
    check(dp_fsdp_create(&h_, module.handle("module"), pg.handle("pg"), &o));
  }
  // On a device mesh: 1-D, as over its group; 2-D, HSDP (shards over
  // dimension 1's group, replicas across dimension 0's).
  Fsdp(Module& module, DeviceMesh& mesh, const FsdpOptions& options = FsdpOptions()) {
    const dp_fsdp_options o = raw(options);
    check(dp_fsdp_create_on_mesh(&h_, module.handle("module"), mesh.handle("mesh"), &o));
  }
  ~Fsdp() {
    if (h_ != nullptr) dp_fsdp_destroy(h_);
  }
  Fsdp(const Fsdp&) = delete;
  Fsdp& operator=(const Fsdp&) = delete;
  // Destroys it (collective) once the calls in flight on it returned.
  void close() {
    if (!gate_.shut()) return;
    dp_fsdp_destroy(h_);
    h_ = nullptr;
  }
  bool isClosed() const { return gate_.isShut(); }
  // All-gather: the module's slots hold the full parameters. With `async`
  // it returns once the gather is issued (waitUnshard completes it).
  void unshard(bool async = false) { check(dp_fsdp_unshard(handle(), async ? 1 : 0)); }
  void waitUnshard() { check(dp_fsdp_wait_unshard(handle())); }
  // The slots hold the shards again (see FsdpOptions.reshardAfterForward).
  void reshard() { check(dp_fsdp_reshard(handle())); }
  // The full gradients are final: reshards, then reduce-scatters their
  // average into the shard gradients, asynchronously.
  void postBackward() { check(dp_fsdp_post_backward(handle())); }
  // A host autograd's per-parameter hook: parameter `name`'s full gradient
  // is final. Any thread, any order; the mark that completes the set runs
  // postBackward itself (a later postBackward for that backward is a
  // no-op). A finishBackward after some marks but not all fails naming the
  // unmarked parameters.
  void markGradReady(const std::string& name) { check(dp_fsdp_mark_grad_ready(handle(), name.c_str())); }
  // Waits for the last postBackward's reduce-scatter.
  void finishBackward() { check(dp_fsdp_finish_backward(handle())); }
  void setRequiresGradientSync(bool requiresSync) {
    check(dp_fsdp_set_requires_gradient_sync(handle(), requiresSync ? 1 : 0));
  }
  size_t numParameters() const { return dp_fsdp_num_parameters(handle()); }
  std::string parameterName(size_t index) const {
    const char* name = nullptr;
    check(dp_fsdp_parameter_name(handle(), index, &name));
    return name != nullptr ? name : "";
  }
  // This rank's rows of parameter `index` (the shard itself: an optimizer
  // updates it in place), and their gradient.
  Tensor* shard(size_t index) const {
    dp_tensor* t = nullptr;
    check(dp_fsdp_shard(handle(), index, &t));
    return t != nullptr ? new Tensor(t, true) : nullptr;
  }
  Tensor* shardGrad(size_t index) const {
    dp_tensor* t = nullptr;
    check(dp_fsdp_shard_grad(handle(), index, &t));
    return t != nullptr ? new Tensor(t, true) : nullptr;
  }

  // The state dict of `module`, whose parameters Fsdp hold. Full: every
  // rank of `pg` calls it, rank 0 writes `path` as Module.save would for the
  // unsharded module. Loading is local: each rank keeps its rows.
  static void saveFullStateDict(Module& module, ProcessGroup& pg, const std::string& path) {
    check(dp_fsdp_save_full_state_dict(module.handle("module"), pg.handle("pg"), path.c_str()));
  }
  // The full state dict in memory: collective as saveFullStateDict; on rank
  // `root` (every rank for -1) a new module of the unsharded tensors, cpu
  // copies under the file's names; null on the other ranks.
  static Module* fullStateDict(Module& module, ProcessGroup& pg, int root = 0) {
    dp_module* out = nullptr;
    check(dp_fsdp_full_state_dict(module.handle("module"), pg.handle("pg"), root, &out));
    return out != nullptr ? new Module(out, true) : nullptr;
  }
  static void loadFullStateDict(Module& module, const std::string& path, bool strict = true) {
    check(dp_fsdp_load_full_state_dict(module.handle("module"), path.c_str(), strict ? 1 : 0));
  }
  // Sharded: each rank writes its own file into `folder`; a load (after
  // every rank's save has returned) may run at another world size.
  static void saveShardedStateDict(Module& module, ProcessGroup& pg, const std::string& folder) {
    check(dp_fsdp_save_sharded_state_dict(module.handle("module"), pg.handle("pg"), folder.c_str()));
  }
  // The sharded save in the background: copies this rank's part aside and
  // returns; the files are written on a library thread, and the Work's
  // waitFor reports the save's outcome, the same on every rank.
  static Work* saveShardedStateDictAsync(Module& module, ProcessGroup& pg, const std::string& folder) {
    dp_work* w = nullptr;
    check(dp_fsdp_save_sharded_state_dict_async(module.handle("module"), pg.handle("pg"), folder.c_str(), &w));
    return new Work(w);
  }
  static void loadShardedStateDict(Module& module, const std::string& folder) {
    check(dp_fsdp_load_sharded_state_dict(module.handle("module"), folder.c_str()));
  }

 private:
  static dp_fsdp_options raw(const FsdpOptions& options) {
    dp_fsdp_options o;
    check(dp_fsdp_options_init(&o, sizeof o));
    o.reshard_after_forward = options.reshardAfterForward ? 1 : 0;
    o.param_dtype = options.paramDtype;
    o.reduce_dtype = options.reduceDtype;
    o.init_sync = options.initSync ? 1 : 0;
    o.full_params_as_views = options.fullParamsAsViews ? 1 : 0;
    return o;
  }
  Lease<dp_fsdp> handle() const { return gate_.hold(h_, "fsdp"); }
  mutable Gate gate_;
  dp_fsdp* h_ = nullptr;
};

}  // namespace dpswig

#endif  // DPARALLEL_BINDINGS_SWIG_FSDP_HPP
