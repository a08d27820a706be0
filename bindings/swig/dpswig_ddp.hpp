// dparallel's SWIG layer: DistributedDataParallel and the custom comm hook.
#ifndef DPARALLEL_BINDINGS_SWIG_DDP_HPP
#define DPARALLEL_BINDINGS_SWIG_DDP_HPP

#include "dpswig_dist.hpp"
#include "dpswig_module.hpp"
#include "dpswig_stream.hpp"

namespace dpswig {

struct HookType {
  static const int ALLREDUCE = DP_HOOK_ALLREDUCE;
  static const int FP16 = DP_HOOK_FP16;
  static const int BF16 = DP_HOOK_BF16;
};

// ---- DDP ----

// The DDP custom comm hook: leaves in `bucket` what the gradients should
// hold, typically by collectives on `pg`. Runs on the library's worker
// thread; `pg` and `bucket` are valid only during the call. Returns false
// when the host's hook failed (the language side keeps the exception).
class CommHook {
 public:
  virtual ~CommHook() {}
  virtual bool invoke(ProcessGroup& pg, size_t bucketIndex, Tensor& bucket) = 0;

  static int trampoline(void* user_data, dp_process_group* pg, size_t bucket_index, dp_tensor* flat_bucket) {
    CommHook* hook = static_cast<CommHook*>(user_data);
    CallbackScope scope;
    try {
      ProcessGroup g(pg, false);
      Tensor b(flat_bucket, false);
      return hook->invoke(g, bucket_index, b) ? 0 : 1;
    } catch (...) {
      hook->pending_.set(std::current_exception());
      return 2;
    }
  }
  void rethrowPending() { pending_.rethrow(); }

 private:
  PendingException pending_;
};

class Ddp;

// The optimizer inside backward: invoke runs on the library's worker thread
// as soon as bucket `bucketIndex`'s averaged gradients are final in the
// module's gradients, while later buckets still reduce; every managed
// parameter is reported once per synced iteration. `ddp` (for
// parameterUsed and the other reads; other calls are Status.STATE) and
// `parameters` are valid only during the call. Returns false when the
// host's callback failed (the language side keeps the exception).
class BucketReduced {
 public:
  virtual ~BucketReduced() {}
  virtual bool invoke(Ddp& ddp, size_t bucketIndex, const std::vector<size_t>& parameters) = 0;

  static int trampoline(void* user_data, dp_ddp* ddp, size_t bucket_index, const size_t* param_indices, size_t nparams);
  void rethrowPending() { pending_.rethrow(); }

 private:
  PendingException pending_;
};

// What the last synced iteration cost: from the first ready mark to the end
// of finishBackward, the time the reductions ran, and the part of it not
// hidden behind the host's backward; the plan's bucket count, and whether
// that iteration rebuilt the buckets.
class DdpStats {
 public:
  double backwardMs() const { return s_.backward_ms; }
  double reduceMs() const { return s_.reduce_ms; }
  double exposedMs() const { return s_.exposed_ms; }
  size_t numBuckets() const { return s_.num_buckets; }
  bool bucketsRebuilt() const { return s_.buckets_rebuilt != 0; }
  explicit DdpStats(const dp_ddp_stats& s) : s_(s) {}

 private:
  dp_ddp_stats s_;
};

struct DdpOptions {
  double bucketCapMb = 25.0;
  double firstBucketCapMb = 1.0;
  bool gradientAsBucketView = false;
  bool broadcastBuffers = true;
  bool findUnusedParameters = false;
  bool initSync = true;
  // HookType.ALLREDUCE, FP16 or BF16; a CommHook passed to Ddp wins.
  int hookType = DP_HOOK_ALLREDUCE;
  // The first synced iteration records the used parameters and the plan;
  // later ones run no used-map collective and must use the same ones.
  bool staticGraph = false;
  // While ranks have joined (Ddp.join), the built-in hooks divide by the
  // initial world size (true) or by the ranks still active.
  bool joinDivideByInitialWorldSize = true;
  // Text from Ddp.bucketPlan() to start with: those buckets, final. Empty:
  // the library plans them.
  std::string bucketPlan;
  // The optimizer inside backward (null: none); the Ddp keeps it.
  void setOnBucketReduced(BucketReduced* callback) { onBucketReduced_ = callback; }
  BucketReduced* onBucketReduced_ = nullptr;
  void ignoreModule(const std::string& dottedName) { ignoredModules_.push_back(dottedName); }
  void ignoreParameter(const std::string& dottedName) { ignoredParameters_.push_back(dottedName); }
  std::vector<std::string> ignoredModules_, ignoredParameters_;
};

class Ddp {
 public:
  // The languages' Ddp constructors call these and keep the options'
  // callback and the hook alive while the Ddp lives.
  static Ddp* create(Module& module, ProcessGroup& pg, const DdpOptions& options) {
    return make(module, pg, options, nullptr);
  }
  // With a custom comm hook.
  static Ddp* withHook(Module& module, ProcessGroup& pg, const DdpOptions& options, CommHook* hook) {
    if (hook == nullptr) fail_argument("'hook' is null");
    return make(module, pg, options, hook);
  }
  ~Ddp() {
    if (owned_ && h_ != nullptr) dp_ddp_destroy(h_);
  }
  Ddp(const Ddp&) = delete;
  Ddp& operator=(const Ddp&) = delete;
  // Destroys the reducer once the calls in flight on it returned.
  void close() {
    if (!gate_.shut()) return;
    if (owned_) dp_ddp_destroy(h_);
    h_ = nullptr;
  }
  bool isClosed() const { return gate_.isShut(); }
  void preForward() { check(dp_ddp_pre_forward(handle())); }
  void markGradReady(const std::string& name) { check(dp_ddp_mark_grad_ready(handle(), name.c_str())); }
  void markGradReady(size_t index) { check(dp_ddp_mark_grad_ready_index(handle(), index)); }
  // The gradient is final once the work queued so far on `stream` (of the
  // parameter's device) completes.
  void markGradReady(size_t index, const Stream& stream) {
    check(dp_ddp_mark_grad_ready_stream(handle(), index, stream.handle("stream")));
  }
  void finishBackward() {
    dp_status s = dp_ddp_finish_backward(handle());
    rethrowPending();
    check(s);
  }
  // This rank has no more data: it stands in for the other ranks'
  // iterations until every rank has joined; then every rank holds the
  // parameters and buffers of the rank that ran the most synced iterations.
  // Every rank passes the same Ddp, in the same order.
  static void join(const std::vector<Ddp*>& ddps) {
    std::vector<Lease<dp_ddp>> leases;
    std::vector<dp_ddp*> raw;
    leases.reserve(ddps.size());
    raw.reserve(ddps.size());
    for (Ddp* d : ddps) {
      if (d == nullptr) fail_argument("'ddps' holds a null Ddp");
      leases.push_back(d->handle("ddps"));
      raw.push_back(leases.back());
    }
    if (raw.empty()) fail_argument("'ddps' is empty");
    dp_status s = dp_ddp_join(raw.data(), raw.size());
    for (Ddp* d : ddps) d->rethrowPending();
    check(s);
  }
  // Whether some rank used managed parameter `index` in the last synced
  // iteration (inside onBucketReduced: the one being reduced).
  bool parameterUsed(size_t index) const {
    int out = 0;
    check(dp_ddp_parameter_used(handle(), index, &out));
    return out != 0;
  }
  // The current bucket plan as text, for DdpOptions.bucketPlan.
  std::string bucketPlan() const {
    Lease<dp_ddp> ddp = handle();
    size_t len = 0;
    check(dp_ddp_bucket_plan(ddp, nullptr, 0, &len));
    std::string out(len + 1, '\0');
    check(dp_ddp_bucket_plan(ddp, &out[0], out.size(), &len));
    out.resize(len);
    return out;
  }
  // Goes on over `pg`, another group (a shrunk one after a peer failed):
  // every rank of `pg` calls it between iterations; the plan and options
  // are kept, the parameters and buffers broadcast from pg's rank 0, the
  // averages divide by pg's size, a custom hook is given `pg` (dp_ddp.h).
  void rebind(ProcessGroup& pg) { check(dp_ddp_rebind(handle(), pg.handle("pg"))); }
  DdpStats lastStats() const {
    dp_ddp_stats s{};
    s.struct_size = sizeof s;
    check(dp_ddp_last_stats(handle(), &s));
    return DdpStats(s);
  }
  void setRequiresGradientSync(bool requiresSync) {
    check(dp_ddp_set_requires_gradient_sync(handle(), requiresSync ? 1 : 0));
  }
  size_t numBuckets() const { return dp_ddp_num_buckets(handle()); }
  std::vector<size_t> bucketParameters(size_t bucket) const {
    Lease<dp_ddp> ddp = handle();
    size_t count = 0;
    check(dp_ddp_bucket_parameters(ddp, bucket, nullptr, 0, &count));
    std::vector<size_t> out(count);
    check(dp_ddp_bucket_parameters(ddp, bucket, out.data(), out.size(), &count));
    return out;
  }

  Ddp(dp_ddp* handle, bool owned) : h_(handle), owned_(owned) {}
  Lease<dp_ddp> handle(const char* arg = nullptr) const { return gate_.hold(h_, "ddp", arg); }

 private:
  Ddp() {}
  void create(Module& module, ProcessGroup& pg, const DdpOptions& options, CommHook* hook) {
    hook_ = hook;
    dp_ddp_options o;
    check(dp_ddp_options_init(&o, sizeof o));
    o.bucket_cap_mb = options.bucketCapMb;
    o.first_bucket_cap_mb = options.firstBucketCapMb;
    o.gradient_as_bucket_view = options.gradientAsBucketView ? 1 : 0;
    o.broadcast_buffers = options.broadcastBuffers ? 1 : 0;
    o.find_unused_parameters = options.findUnusedParameters ? 1 : 0;
    o.init_sync = options.initSync ? 1 : 0;
    std::vector<const char*> modules, params;
    for (const std::string& s : options.ignoredModules_) modules.push_back(s.c_str());
    for (const std::string& s : options.ignoredParameters_) params.push_back(s.c_str());
    o.ignored_modules = modules.data();
    o.num_ignored_modules = modules.size();
    o.ignored_parameters = params.data();
    o.num_ignored_parameters = params.size();
    o.comm_hook = options.hookType;
    o.static_graph = options.staticGraph ? 1 : 0;
    o.join_divide_by_initial_world_size = options.joinDivideByInitialWorldSize ? 1 : 0;
    o.bucket_plan = options.bucketPlan.empty() ? nullptr : options.bucketPlan.c_str();
    reduced_ = options.onBucketReduced_;
    if (reduced_ != nullptr) {
      o.on_bucket_reduced = &BucketReduced::trampoline;
      o.on_bucket_reduced_data = reduced_;
    }
    if (hook != nullptr) {
      o.comm_hook = DP_HOOK_CUSTOM;
      o.hook_fn = &CommHook::trampoline;
      o.hook_user_data = hook;
    }
    check(dp_ddp_create(&h_, module.handle("module"), pg.handle("pg"), &o));
  }

  static Ddp* make(Module& module, ProcessGroup& pg, const DdpOptions& options, CommHook* hook) {
    Ddp* ddp = new Ddp();
    try {
      ddp->create(module, pg, options, hook);
    } catch (...) {
      delete ddp;
      throw;
    }
    return ddp;
  }
  void rethrowPending() {
    if (hook_ != nullptr) hook_->rethrowPending();
    if (reduced_ != nullptr) reduced_->rethrowPending();
  }

  mutable Gate gate_;
  dp_ddp* h_ = nullptr;
  bool owned_ = true;
  CommHook* hook_ = nullptr;
  BucketReduced* reduced_ = nullptr;
};

inline int BucketReduced::trampoline(void* user_data, dp_ddp* ddp, size_t bucket_index, const size_t* param_indices,
                                     size_t nparams) {
  BucketReduced* callback = static_cast<BucketReduced*>(user_data);
  CallbackScope scope;
  try {
    Ddp d(ddp, false);
    std::vector<size_t> params(param_indices, param_indices + nparams);
    return callback->invoke(d, bucket_index, params) ? 0 : 1;
  } catch (...) {
    callback->pending_.set(std::current_exception());
    return 2;
  }
}

}  // namespace dpswig

#endif  // DPARALLEL_BINDINGS_SWIG_DDP_HPP
