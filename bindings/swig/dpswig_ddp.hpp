// dparallel's SWIG layer: DistributedDataParallel and the custom comm hook.
#ifndef DPARALLEL_BINDINGS_SWIG_DDP_HPP
#define DPARALLEL_BINDINGS_SWIG_DDP_HPP

#include "dpswig_dist.hpp"
#include "dpswig_module.hpp"

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

struct DdpOptions {
  double bucketCapMb = 25.0;
  double firstBucketCapMb = 1.0;
  bool gradientAsBucketView = false;
  bool broadcastBuffers = true;
  bool findUnusedParameters = false;
  bool initSync = true;
  // HookType.ALLREDUCE, FP16 or BF16; a CommHook passed to Ddp wins.
  int hookType = DP_HOOK_ALLREDUCE;
  void ignoreModule(const std::string& dottedName) { ignoredModules_.push_back(dottedName); }
  void ignoreParameter(const std::string& dottedName) { ignoredParameters_.push_back(dottedName); }
  std::vector<std::string> ignoredModules_, ignoredParameters_;
};

class Ddp {
 public:
  Ddp(Module& module, ProcessGroup& pg, const DdpOptions& options) { create(module, pg, options, nullptr); }
  // With a custom comm hook, which the caller keeps alive while the Ddp
  // lives (the languages' Ddp constructors hold it).
  static Ddp* withHook(Module& module, ProcessGroup& pg, const DdpOptions& options, CommHook* hook) {
    if (hook == nullptr) fail_argument("'hook' is null");
    Ddp* ddp = new Ddp();
    try {
      ddp->create(module, pg, options, hook);
    } catch (...) {
      delete ddp;
      throw;
    }
    return ddp;
  }
  ~Ddp() { dp_ddp_destroy(h_); }
  Ddp(const Ddp&) = delete;
  Ddp& operator=(const Ddp&) = delete;
  void close() {
    dp_ddp_destroy(h_);
    h_ = nullptr;
  }
  void preForward() { check(dp_ddp_pre_forward(handle())); }
  void markGradReady(const std::string& name) { check(dp_ddp_mark_grad_ready(handle(), name.c_str())); }
  void markGradReady(size_t index) { check(dp_ddp_mark_grad_ready_index(handle(), index)); }
  void finishBackward() {
    dp_status s = dp_ddp_finish_backward(handle());
    if (hook_ != nullptr) hook_->rethrowPending();
    check(s);
  }
  void setRequiresGradientSync(bool requiresSync) {
    check(dp_ddp_set_requires_gradient_sync(handle(), requiresSync ? 1 : 0));
  }
  size_t numBuckets() const { return dp_ddp_num_buckets(handle()); }
  std::vector<size_t> bucketParameters(size_t bucket) const {
    size_t count = 0;
    check(dp_ddp_bucket_parameters(handle(), bucket, nullptr, 0, &count));
    std::vector<size_t> out(count);
    check(dp_ddp_bucket_parameters(handle(), bucket, out.data(), out.size(), &count));
    return out;
  }

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
    if (hook != nullptr) {
      o.comm_hook = DP_HOOK_CUSTOM;
      o.hook_fn = &CommHook::trampoline;
      o.hook_user_data = hook;
    }
    check(dp_ddp_create(&h_, module.handle(), pg.handle(), &o));
  }

  dp_ddp* handle() const {
    if (h_ == nullptr) throw Error(DP_ESTATE, "the ddp is closed");
    return h_;
  }
  dp_ddp* h_ = nullptr;
  CommHook* hook_ = nullptr;
};

}  // namespace dpswig

#endif  // DPARALLEL_BINDINGS_SWIG_DDP_HPP
