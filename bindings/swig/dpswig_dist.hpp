// dparallel's SWIG layer: stores, process groups and their async work.
#ifndef DPARALLEL_BINDINGS_SWIG_DIST_HPP
#define DPARALLEL_BINDINGS_SWIG_DIST_HPP

#include <memory>

#include "dpswig_tensor.hpp"

namespace dpswig {

struct ReduceOp {
  static const int SUM = DP_SUM;
  static const int AVG = DP_AVG;
  static const int MIN = DP_MIN;
  static const int MAX = DP_MAX;
  static const int PROD = DP_PROD;
};
// The backend a process group asks for (every rank the same one);
// ProcessGroup.backend() says what runs. AUTO: NCCL for cuda, shared memory
// for cpu ranks on one host, Gloo across hosts. SHM fails when the ranks
// span several hosts.
struct Backend {
  static const int AUTO = DP_BACKEND_AUTO;
  static const int GLOO = DP_BACKEND_GLOO;
  static const int NCCL = DP_BACKEND_NCCL;
  static const int SHM = DP_BACKEND_SHM;
  static const int MPI = DP_BACKEND_MPI;  // the site's MPI, loaded at run time; ranks started by mpirun
};
// ---- processes ----

class Store {
 public:
  static Store* tcp(const std::string& host, int port, int worldSize, bool isServer, int timeoutMs) {
    if (port < 0 || port > 65535) fail_argument("'port' must be in 0..65535");
    Store* s = new Store();
    dp_status st =
        dp_store_create_tcp(&s->h_, host.c_str(), static_cast<uint16_t>(port), worldSize, isServer ? 1 : 0, timeoutMs);
    if (st < 0) delete s;
    check(st);
    return s;
  }
  static Store* file(const std::string& path, int worldSize) {
    Store* s = new Store();
    dp_status st = dp_store_create_file(&s->h_, path.c_str(), worldSize);
    if (st < 0) delete s;
    check(st);
    return s;
  }
  ~Store() {
    if (h_ != nullptr) dp_store_destroy(h_);
  }
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;
  // Destroys the store once the calls in flight on it returned.
  void close() {
    if (!gate_.shut()) return;
    dp_store_destroy(h_);
    h_ = nullptr;
  }
  bool isClosed() const { return gate_.isShut(); }
  void set(const std::string& key, const std::string& value) {
    check(dp_store_set(handle(), key.c_str(), value.data(), value.size()));
  }
  std::string get(const std::string& key) {
    Lease<dp_store> store = handle();
    size_t len = 0;
    check(dp_store_get(store, key.c_str(), nullptr, 0, &len));
    std::string out(len, '\0');
    check(dp_store_get(store, key.c_str(), len > 0 ? &out[0] : nullptr, len, &len));
    out.resize(len);
    return out;
  }
  long long add(const std::string& key, long long delta) {
    int64_t out = 0;
    check(dp_store_add(handle(), key.c_str(), delta, &out));
    return out;
  }
  void waitFor(const std::vector<std::string>& keys, int timeoutMs = -1) {
    std::vector<const char*> k;
    for (const std::string& key : keys) k.push_back(key.c_str());
    check(dp_store_wait(handle(), k.data(), k.size(), timeoutMs));
  }
  int port() const {
    uint16_t p = 0;
    check(dp_store_tcp_port(handle(), &p));
    return p;
  }
  void setTimeout(int timeoutMs) { check(dp_store_set_timeout(handle(), timeoutMs)); }
  Lease<dp_store> handle(const char* arg = nullptr) const { return gate_.hold(h_, "store", arg); }

 private:
  Store() {}
  mutable Gate gate_;
  dp_store* h_ = nullptr;
};

class Work {
 public:
  ~Work() {
    if (h_ != nullptr) dp_work_destroy(h_);
  }
  Work(const Work&) = delete;
  Work& operator=(const Work&) = delete;
  // Drops the handle once the calls in flight on it returned (the
  // collective still completes).
  void close() {
    if (!gate_.shut()) return;
    dp_work_destroy(h_);
    h_ = nullptr;
  }
  bool isClosed() const { return gate_.isShut(); }
  void waitFor() { check(dp_work_wait(handle())); }
  bool test() {
    int done = 0;
    check(dp_work_test(handle(), &done));
    return done != 0;
  }
  explicit Work(dp_work* handle) : h_(handle) {}

 private:
  Lease<dp_work> handle() const { return gate_.hold(h_, "work"); }
  mutable Gate gate_;
  dp_work* h_ = nullptr;
};

class ProcessGroup {
 public:
  // Rank, world size and store from the environment dp-run, torchrun or
  // mpirun sets; tensors on `device`.
  static ProcessGroup* fromEnv(const Device& device = Device(), int timeoutMs = 300000, int backend = DP_BACKEND_AUTO) {
    dp_process_group_options opts;
    check(dp_process_group_options_init(&opts, sizeof opts));
    opts.device = device.raw();
    opts.timeout_ms = timeoutMs;
    opts.backend = backend;
    ProcessGroup* pg = new ProcessGroup(nullptr, true);
    dp_status s = dp_process_group_create_from_env(&pg->h_, &opts);
    if (s < 0) delete pg;
    check(s);
    return pg;
  }
  // Every rank calls it with the same store and world size.
  static ProcessGroup* create(Store& store, int rank, int worldSize, const Device& device = Device(),
                              int timeoutMs = 300000, int backend = DP_BACKEND_AUTO) {
    dp_process_group_options opts;
    check(dp_process_group_options_init(&opts, sizeof opts));
    Lease<dp_store> held = store.handle("store");
    opts.store = held;
    opts.rank = rank;
    opts.world_size = worldSize;
    opts.device = device.raw();
    opts.timeout_ms = timeoutMs;
    opts.backend = backend;
    ProcessGroup* pg = new ProcessGroup(nullptr, true);
    dp_status s = dp_process_group_create(&pg->h_, &opts);
    if (s < 0) delete pg;
    check(s);
    return pg;
  }
  ~ProcessGroup() {
    if (owned_ && h_ != nullptr) dp_process_group_destroy(h_);
  }
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;
  // Leaves the group once the calls in flight on it returned.
  void close() {
    if (!gate_.shut()) return;
    if (owned_) dp_process_group_destroy(h_);
    h_ = nullptr;
  }
  bool isClosed() const { return gate_.isShut(); }
  int rank() const { return dp_process_group_rank(handle()); }
  int size() const { return dp_process_group_size(handle()); }
  std::string backend() const { return dp_process_group_backend(handle()); }
  // Among the group's ranks on this host (as its creation learnt them).
  int localRank() const { return dp_process_group_local_rank(handle()); }
  int localSize() const { return dp_process_group_local_size(handle()); }
  int numHosts() const { return dp_process_group_num_hosts(handle()); }
  // From any thread, also while another thread's call runs: every later
  // call fails ("aborted"), and the peers' next calls fail rather than wait
  // for their timeout; a running call fails at once on shared memory, NCCL
  // and MPI, at its deadline on Gloo (dp_dist.h). close() is still needed.
  void abort() { check(dp_process_group_abort(handle())); }
  // After a peer's failure, every survivor calls it: they agree on who is
  // left and each gets a new group of the survivors in their old order
  // (dp_dist.h). This group is left as it was; close() it.
  ProcessGroup* shrink() {
    dp_process_group* shrunk = nullptr;
    check(dp_process_group_shrink(handle(), &shrunk));
    return new ProcessGroup(shrunk, true);
  }
  // The ranks this group's last shrink left out (for a group made by a
  // shrink: those left out of the group it came from).
  std::vector<int> lostRanks() const {
    int32_t n = dp_process_group_lost_ranks(handle(), nullptr, 0);
    std::vector<int32_t> out(n < 0 ? 0 : static_cast<size_t>(n));
    if (n >= 0) n = dp_process_group_lost_ranks(handle(), out.data(), out.size());
    if (n < 0) check(DP_EINVAL);
    out.resize(std::min(out.size(), static_cast<size_t>(n)));
    return std::vector<int>(out.begin(), out.end());
  }
  // Collective over this group (MPI_Comm_split): the ranks passing the same
  // color >= 0 form a new group ranked by (key, rank here); a negative color
  // joins none (null). The new group has this one's timeout and device.
  ProcessGroup* split(int color, int key) { return splitWith(color, key, nullptr); }
  // As split, the new group on `device` with `timeoutMs` and `backend`.
  ProcessGroup* split(int color, int key, const Device& device, int timeoutMs, int backend = DP_BACKEND_AUTO) {
    dp_process_group_options opts;
    check(dp_process_group_options_init(&opts, sizeof opts));
    opts.device = device.raw();
    opts.timeout_ms = timeoutMs;
    opts.backend = backend;
    return splitWith(color, key, &opts);
  }
  void allReduce(Tensor& tensor, int op = DP_SUM) { check(dp_pg_all_reduce(handle(), tensor.handle(), op)); }
  Work* allReduceAsync(Tensor& tensor, int op = DP_SUM) {
    dp_work* w = nullptr;
    check(dp_pg_all_reduce_async(handle(), tensor.handle(), op, &w));
    return new Work(w);
  }
  void broadcast(Tensor& tensor, int root) { check(dp_pg_broadcast(handle(), tensor.handle(), root)); }
  Work* broadcastAsync(Tensor& tensor, int root) {
    dp_work* w = nullptr;
    check(dp_pg_broadcast_async(handle(), tensor.handle(), root, &w));
    return new Work(w);
  }
  // outputs[r] receives rank r's input (one output per rank, each of the
  // input's dtype and numel).
  void allGather(const Tensor& input, const std::vector<Tensor*>& outputs) {
    TensorArgs out(outputs, "outputs");
    check(dp_pg_all_gather(handle(), input.handle(), out.raw().data(), out.raw().size()));
  }
  Work* allGatherAsync(const Tensor& input, const std::vector<Tensor*>& outputs) {
    TensorArgs out(outputs, "outputs");
    dp_work* w = nullptr;
    check(dp_pg_all_gather_async(handle(), input.handle(), out.raw().data(), out.raw().size(), &w));
    return new Work(w);
  }
  // output = the reduction over the ranks of their inputs[this rank] (one
  // input per rank).
  void reduceScatter(const std::vector<Tensor*>& inputs, Tensor& output, int op = DP_SUM) {
    TensorArgs in(inputs, "inputs");
    const std::vector<const dp_tensor*>& cin = in.craw();
    check(dp_pg_reduce_scatter(handle(), cin.data(), cin.size(), output.handle(), op));
  }
  Work* reduceScatterAsync(const std::vector<Tensor*>& inputs, Tensor& output, int op = DP_SUM) {
    TensorArgs in(inputs, "inputs");
    const std::vector<const dp_tensor*>& cin = in.craw();
    dp_work* w = nullptr;
    check(dp_pg_reduce_scatter_async(handle(), cin.data(), cin.size(), output.handle(), op, &w));
    return new Work(w);
  }
  void barrier() { check(dp_pg_barrier(handle())); }
  Work* barrierAsync() {
    dp_work* w = nullptr;
    check(dp_pg_barrier_async(handle(), &w));
    return new Work(w);
  }

  ProcessGroup(dp_process_group* handle, bool owned) : h_(handle), owned_(owned) {}
  // A borrowed group whose owner `keep` holds (a mesh's dimension).
  ProcessGroup(dp_process_group* handle, std::shared_ptr<void> keep)
      : h_(handle), owned_(false), keep_(std::move(keep)) {}
  Lease<dp_process_group> handle(const char* arg = nullptr) const { return gate_.hold(h_, "process group", arg); }

 private:
  ProcessGroup* splitWith(int color, int key, const dp_process_group_options* opts) {
    dp_process_group* child = nullptr;
    check(dp_process_group_split(handle(), color, key, opts, &child));
    return child == nullptr ? nullptr : new ProcessGroup(child, true);
  }

  mutable Gate gate_;
  dp_process_group* h_ = nullptr;
  bool owned_ = true;
  std::shared_ptr<void> keep_;  // what keeps a borrowed handle alive
};

// A group's ranks laid out as an n-dimensional array with one group per
// dimension (PyTorch's init_device_mesh); creating one is collective.
class DeviceMesh {
 public:
  // The group's ranks row-major over `shape`; `names` one per dimension, or
  // empty for "dim0", "dim1", ...
  static DeviceMesh* create(ProcessGroup& pg, const std::vector<int>& shape,
                            const std::vector<std::string>& names = std::vector<std::string>()) {
    if (!names.empty() && names.size() != shape.size()) {
      fail_argument(
          ("'names' has " + std::to_string(names.size()) + " names for " + std::to_string(shape.size()) + " dimensions")
              .c_str());
    }
    std::vector<int32_t> extents(shape.begin(), shape.end());
    std::vector<const char*> raw;
    for (const std::string& name : names) raw.push_back(name.c_str());
    dp_device_mesh* mesh = nullptr;
    check(dp_device_mesh_create(&mesh, pg.handle("pg"), extents.data(), extents.size(),
                                names.empty() ? nullptr : raw.data()));
    return new DeviceMesh(mesh);
  }
  // ("host", "local"): one row per host.
  static DeviceMesh* byHost(ProcessGroup& pg) {
    dp_device_mesh* mesh = nullptr;
    check(dp_device_mesh_create_by_host(&mesh, pg.handle("pg")));
    return new DeviceMesh(mesh);
  }
  DeviceMesh(const DeviceMesh&) = delete;
  DeviceMesh& operator=(const DeviceMesh&) = delete;
  // Leaves the mesh's groups once the calls in flight on the mesh returned
  // and every group taken from it is closed.
  void close() {
    if (!gate_.shut()) return;
    h_ = nullptr;
    owner_.reset();
  }
  bool isClosed() const { return gate_.isShut(); }
  long ndim() const { return static_cast<long>(dims(handle())); }
  std::vector<int> shape() const {
    Lease<dp_device_mesh> mesh = handle();
    std::vector<int32_t> out(dims(mesh));
    check(dp_device_mesh_shape(mesh, out.data(), out.size()));
    return std::vector<int>(out.begin(), out.end());
  }
  // This rank's coordinate along each dimension.
  std::vector<int> coordinate() const {
    Lease<dp_device_mesh> mesh = handle();
    std::vector<int32_t> out(dims(mesh));
    check(dp_device_mesh_coordinate(mesh, out.data(), out.size()));
    return std::vector<int>(out.begin(), out.end());
  }
  std::string dimName(long dim) const {
    if (dim < 0) fail_argument(("'dim' is negative (" + std::to_string(dim) + ")").c_str());
    const char* name = nullptr;
    check(dp_device_mesh_dim_name(handle(), static_cast<size_t>(dim), &name));
    return name;
  }
  // The group of dimension `name`; it keeps the mesh's groups alive while
  // open, and closing it leaves the mesh as it is.
  ProcessGroup* group(const std::string& name) const {
    Lease<dp_device_mesh> mesh = handle();
    dp_process_group* pg = nullptr;
    check(dp_device_mesh_group(mesh, name.c_str(), &pg));
    return new ProcessGroup(pg, owner_);
  }
  Lease<dp_device_mesh> handle(const char* arg = nullptr) const { return gate_.hold(h_, "device mesh", arg); }

 private:
  explicit DeviceMesh(dp_device_mesh* mesh)
      : h_(mesh), owner_(mesh, [](dp_device_mesh* m) { dp_device_mesh_destroy(m); }) {}
  // A live mesh has at least one dimension.
  static size_t dims(const dp_device_mesh* mesh) { return dp_device_mesh_ndim(mesh); }

  mutable Gate gate_;
  dp_device_mesh* h_ = nullptr;
  std::shared_ptr<dp_device_mesh> owner_;
};

}  // namespace dpswig

#endif  // DPARALLEL_BINDINGS_SWIG_DIST_HPP
