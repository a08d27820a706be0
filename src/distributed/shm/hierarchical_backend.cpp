// The hierarchical cpu group: ranks on several hosts, the same number (at
// least 2) on each, over two backends the choice hands it from the registry
// (backend_registry.h): a local one that joins one host's ranks (shared
// memory) and one that crosses hosts (Gloo). Three groups inside it, made in
// this order on every rank:
//   local: the ranks of this host, through the local backend;
//   cross: the ranks with this rank's local index, one per host, through the
//   cross-host backend;
//   world: every rank, through the cross-host backend.
// Its name joins theirs: "shm+gloo".
// Each collective first swaps this group's call headers (call_header.h),
// inside each host through the local group, then across hosts through the
// cross group, and every rank checks them:
// mismatched, refused or out-of-step calls get the same verdicts as on a
// flat group, before any of the caller's data changes. Then:
//   all_reduce: a reduce-scatter inside the host (each local rank gets one
//   slice), an all-reduce of its slice with its peers on the other hosts,
//   and an all-gather inside the host. DP_AVG sums at both levels and divides
//   once by the world size. Every step reduces in a fixed order, so results
//   are bitwise the same run to run (and on every rank).
//   A small all_reduce crosses hosts once: the cross-host header exchange
//   always carries kCrossBlockBytes per rank, and a slice that fits rides
//   in it. The host's ranks reduce-scatter into that block before it leaves
//   when their own headers agree (a host whose headers disagree sends none,
//   and the verdict then fails on every rank); after the verdict each rank
//   adds the hosts' slices in host order, as the cross group's all-reduce
//   would.
//   broadcast, all_gather, reduce_scatter: the world group's.
//   barrier: the header exchange itself.
// A step that fails (a dead or stopped peer, a timeout) aborts all three
// groups, so that peers blocked in another of them fail now too, and every
// rank reports the failure through the store naming the ranks, by their rank
// in this group, that did not.
#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "core/error.h"
#include "distributed/call_header.h"
#include "distributed/reduce_ops.h"
#include "distributed/shm/shm_process_group.h"

namespace dparallel::dist {

namespace {

// What one cross-host header exchange carries per rank: the host's headers,
// then room for a small all_reduce's slice. One round of Gloo's header
// exchange carries this much inline, so the room costs nothing extra there.
constexpr size_t kCrossBlockBytes = 4096;

// "<local>+<cross>", as static text that lives as long as the process
// (backend_name() hands it out as such).
const char* joined_name(const BackendEntry& local, const BackendEntry& cross) {
  static std::mutex mutex;
  static std::set<std::string> names;
  std::lock_guard<std::mutex> lock(mutex);
  return names.insert(str_cat(local.name, "+", cross.name)).first->c_str();
}

class HierarchicalBackend : public Backend {
 public:
  HierarchicalBackend(CallSite& site, const ProcessGroupOptions& options, const std::string& prefix,
                      const HostLayout& layout, const BackendEntry& local_backend, const BackendEntry& cross_backend)
      : Backend(site),
        store_(options.store),
        prefix_(prefix + "hier/"),
        name_(joined_name(local_backend, cross_backend)),
        local_name_(local_backend.name),
        cross_name_(cross_backend.name),
        local_rank_(layout.local_rank),
        local_size_(layout.local_size) {
    set_failure_reports(store_, prefix_);
    ProcessGroupOptions local = options;
    local.rank = layout.local_rank;
    local.world_size = layout.local_size;
    local.network_paced = true;  // the host's peers wait on the cross-host leg
    const BackendSetup local_setup{str_cat(prefix_, "host", layout.host, "/"), layout.local_pids};
    local_ = make_process_group(local, [&](CallSite& part) { return local_backend.make(part, local, local_setup); });
    // The cross-host groups have stores of their own: no prefix, no pids.
    const BackendSetup cross_setup;
    ProcessGroupOptions cross = options;
    cross.rank = layout.host;
    cross.world_size = layout.hosts;
    cross.store = std::make_shared<PrefixStore>(options.store, str_cat(prefix_, "cross", layout.local_rank, "/"));
    cross_ = make_process_group(cross, [&](CallSite& part) { return cross_backend.make(part, cross, cross_setup); });
    ProcessGroupOptions world = options;
    world.store = std::make_shared<PrefixStore>(options.store, prefix_ + "world/");
    world_ = make_process_group(world, [&](CallSite& part) { return cross_backend.make(part, world, cross_setup); });
    const size_t header = sizeof(CallHeader);
    const auto per_host = static_cast<size_t>(layout.local_size);
    const auto hosts = static_cast<size_t>(layout.hosts);
    headers_bytes_ = per_host * header;
    block_bytes_ = std::max(kCrossBlockBytes, headers_bytes_);
    mine_ = Tensor::empty(DType::kUInt8, {static_cast<int64_t>(header)}, device());
    host_block_ = Tensor::zeros(DType::kUInt8, {static_cast<int64_t>(block_bytes_)}, device());
    for (size_t i = 0; i < per_host; ++i) {
      host_header_views_.push_back(host_block_.view_at(i * header, DType::kUInt8, {static_cast<int64_t>(header)}));
    }
    gathered_blocks_ = Tensor::empty(DType::kUInt8, {static_cast<int64_t>(hosts * block_bytes_)}, device());
    for (size_t h = 0; h < hosts; ++h) {
      gathered_host_views_.push_back(
          gathered_blocks_.view_at(h * block_bytes_, DType::kUInt8, {static_cast<int64_t>(block_bytes_)}));
    }
    headers_.resize(static_cast<size_t>(size()));
  }

  const char* name() const override { return name_; }

  void abort(const std::string& why) noexcept override { abort_parts(why); }

  // Regions and in-place runs are the local group's alone; the world's
  // collectives cross hosts.
  BackendCapabilities capabilities() const override { return {}; }

  void all_reduce(const Tensor& tensor, ReduceOp op) override {
    const auto n = static_cast<size_t>(tensor.numel());
    const auto local = static_cast<size_t>(local_size_);
    const size_t chunk = (n + local - 1) / local;
    const size_t esize = tensor.element_size();
    // The slices: views of the tensor when it splits evenly, else of a
    // scratch tensor, allocated before the header exchange (failing after it
    // would leave the peers waiting).
    const bool direct = n % local == 0;
    Tensor base = tensor.view({static_cast<int64_t>(n)});
    if (!direct) {
      try {
        base = scratch(tensor.dtype(), chunk * local);
      } catch (const Error& e) {
        if (e.code() != StatusCode::kOutOfMemory) throw;
        refuse_out_of_memory(CallKind::kAllReduce, "all_reduce",
                             str_cat("out of memory for the ", chunk * local, "-element scratch of an all_reduce"));
      }
    }
    Call o = begin_call(CallKind::kAllReduce, tensor.dtype(), tensor.numel(), op, -1, &tensor);
    const ReduceOp inner = op == ReduceOp::kAvg ? ReduceOp::kSum : op;
    // Only scratch (never the caller's tensor) changes before the verdict.
    std::vector<Tensor> slices;
    auto cut_slices = [&] {
      if (!direct) {
        std::memcpy(base.data(), tensor.data(), n * esize);
        std::memset(static_cast<uint8_t*>(base.data()) + n * esize, 0, (chunk * local - n) * esize);
      }
      for (size_t q = 0; q < local; ++q) {
        slices.push_back(base.view_at(q * chunk * esize, tensor.dtype(), {static_cast<int64_t>(chunk)}));
      }
    };
    const bool rides = n > 0 && chunk * esize <= block_bytes_ - headers_bytes_;
    if (rides) {
      cut_slices();
      riding_ = Riding{&slices, inner};
    }
    struct ClearRiding {
      std::optional<Riding>& riding;
      ~ClearRiding() { riding.reset(); }
    } clear_riding{riding_};
    exchange_headers(o);
    if (n == 0) return;
    if (!rides) cut_slices();
    const Tensor& mine = slices[static_cast<size_t>(local_rank_)];
    if (rides) {
      // The verdict passed: every host reduce-scattered into its block.
      ReduceFn fn = reduce_function(tensor.dtype(), inner);
      auto* out = mine.data();
      const auto* blocks = static_cast<const uint8_t*>(gathered_blocks_.data()) + headers_bytes_;
      std::memcpy(out, blocks, chunk * esize);
      for (size_t h = 1; h < gathered_host_views_.size(); ++h) fn(out, out, blocks + h * block_bytes_, chunk);
    } else {
      step(o, local_name_, "reduce-scatter among this host's ranks",
           [&] { local_->reduce_scatter(slices, mine, inner, false); });
      step(o, cross_name_, "all-reduce with the ranks of this local index on the other hosts",
           [&] { cross_->all_reduce(mine, inner, false); });
    }
    if (op == ReduceOp::kAvg) divide_in_place(tensor.dtype(), mine.data(), chunk, size());
    step(o, local_name_, "all-gather among this host's ranks", [&] { local_->all_gather(mine, slices, false); });
    if (!direct) std::memcpy(tensor.data(), base.data(), n * esize);
  }

  void broadcast(const Tensor& tensor, int32_t root) override {
    Call o = begin_call(CallKind::kBroadcast, tensor.dtype(), tensor.numel(), ReduceOp::kSum, root, &tensor);
    exchange_headers(o);
    if (tensor.numel() == 0) return;  // every rank's is empty: the headers matched
    step(o, cross_name_, "broadcast", [&] { world_->broadcast(tensor, root, false); });
  }

  void all_gather(const Tensor& input, const std::vector<Tensor>& outputs) override {
    Call o = begin_call(CallKind::kAllGather, input.dtype(), input.numel(), ReduceOp::kSum, -1, &input);
    exchange_headers(o);
    if (input.numel() == 0) return;
    step(o, cross_name_, "all-gather", [&] { world_->all_gather(input, outputs, false); });
  }

  void reduce_scatter(const std::vector<Tensor>& inputs, const Tensor& output, ReduceOp op) override {
    Call o = begin_call(CallKind::kReduceScatter, output.dtype(), output.numel(), op, -1, &output);
    exchange_headers(o);
    if (output.numel() == 0) return;
    step(o, cross_name_, "reduce-scatter", [&] { world_->reduce_scatter(inputs, output, op, false); });
  }

  void barrier() override {
    Call o = begin_call(CallKind::kBarrier, DType::kUInt8, 0, ReduceOp::kSum, -1, nullptr);
    exchange_headers(o);
  }

  // Swaps the call headers in two steps: among this host's ranks through
  // the local group, then the host's headers with the ranks of this local
  // index on the other hosts through the cross group (only 2 of its ranks
  // per exchange with 2 hosts, not every rank). Each header lands in the slot its
  // rank field names; a slot nobody filled stays zero, which the verdict
  // reads as a malformed header.
  void swap_headers(Call& o) override {
    std::memcpy(mine_.data(), &o.header, sizeof(CallHeader));
    step(o, local_name_, "header exchange among this host's ranks",
         [&] { local_->all_gather(mine_, host_header_views_, false); });
    if (riding_ && host_agrees(o.header)) {
      const std::vector<Tensor>& slices = *riding_->slices;
      const Tensor& first = slices.front();
      Tensor slice = host_block_.view_at(headers_bytes_, first.dtype(), first.shape());
      step(o, local_name_, "reduce-scatter among this host's ranks",
           [&] { local_->reduce_scatter(slices, slice, riding_->op, false); });
    }
    step(o, cross_name_, "header exchange with the other hosts",
         [&] { cross_->all_gather(host_block_, gathered_host_views_, false); });
    std::fill(headers_.begin(), headers_.end(), CallHeader{});
    const auto* gathered = static_cast<const uint8_t*>(gathered_blocks_.data());
    for (size_t h = 0; h < gathered_host_views_.size(); ++h) {
      for (size_t at = 0; at < headers_bytes_; at += sizeof(CallHeader)) {
        CallHeader header;
        std::memcpy(&header, gathered + h * block_bytes_ + at, sizeof(CallHeader));
        if (header.rank >= 0 && header.rank < size()) headers_[static_cast<size_t>(header.rank)] = header;
      }
    }
  }
  CallHeader received_header(int32_t r) override { return headers_[static_cast<size_t>(r)]; }

 private:
  // Runs one step of a collective on a part; a failure aborts every part and
  // names the ranks of this group that did not report it.
  template <typename F>
  void step(const Call& o, const char* leg, const char* what, F&& f) {
    try {
      f();
      return;
    } catch (const Error& e) {
      // A verdict every rank of the part reached; or this rank's refusal for
      // want of scratch memory, which the part's backends allocate before
      // their header exchange: the part, and so this group, stays in step.
      if (e.code() == StatusCode::kInvalidArgument || e.code() == StatusCode::kOutOfMemory) throw;
      StatusCode code = e.code() == StatusCode::kTimeout ? e.code() : StatusCode::kRemote;
      // The part numbers its ranks its own way; this group's ranks are named above.
      std::string cause = str_cat(leg, " ", what, " (ranks numbered within that group): ", e.what());
      mark_broken(cause);
      abort_parts(cause);
      fail_call(o, code, cause);
    }
  }

  // Whether this host's ranks all made the call `mine` describes, as the
  // verdict compares calls (their local group can then reduce-scatter).
  bool host_agrees(const CallHeader& mine) const {
    const auto* headers = static_cast<const uint8_t*>(host_block_.data());
    for (size_t at = 0; at < headers_bytes_; at += sizeof(CallHeader)) {
      CallHeader h;
      std::memcpy(&h, headers + at, sizeof(CallHeader));
      if (h.magic != kCallHeaderMagic || h.refused != 0 || mine.refused != 0 || h.kind != mine.kind ||
          h.seq != mine.seq || h.tag != mine.tag || h.numel != mine.numel || h.dtype != mine.dtype || h.op != mine.op ||
          h.root != mine.root) {
        return false;
      }
    }
    return true;
  }

  void abort_parts(const std::string& why) noexcept {
    for (ProcessGroup* part : {local_.get(), cross_.get(), world_.get()}) {
      if (part != nullptr) part->abort(why);
    }
  }

  // A tensor of `numel` elements of `dtype` over scratch memory kept across calls.
  Tensor scratch(DType dtype, size_t numel) {
    const size_t bytes = numel * dtype_size(dtype);
    if (!scratch_.defined() || scratch_.nbytes() < bytes) {
      scratch_ = Tensor();
      scratch_ = Tensor::empty(DType::kUInt8, {static_cast<int64_t>(bytes)}, device());
    }
    return scratch_.view_at(0, dtype, {static_cast<int64_t>(numel)});
  }

  std::shared_ptr<Store> store_;
  std::string prefix_;
  const char* name_;
  const char* local_name_;  // the local backend's, in failures
  const char* cross_name_;  // the cross-host backend's, in failures
  int32_t local_rank_;
  int32_t local_size_;
  std::unique_ptr<ProcessGroup> local_;
  std::unique_ptr<ProcessGroup> cross_;
  std::unique_ptr<ProcessGroup> world_;
  // A small all_reduce's slices, reduce-scattered into host_block_ by the
  // header exchange (set for its exchange only).
  struct Riding {
    const std::vector<Tensor>* slices;
    ReduceOp op;
  };
  Tensor mine_;                              // this rank's call header
  size_t headers_bytes_ = 0;                 // a host's headers
  size_t block_bytes_ = 0;                   // what each rank sends across hosts per exchange
  Tensor host_block_;                        // this host's headers by local index, then this rank's slice
  std::vector<Tensor> host_header_views_;    // local rank i's header in host_block_
  Tensor gathered_blocks_;                   // every host's block, by host
  std::vector<Tensor> gathered_host_views_;  // host h's in gathered_blocks_
  std::vector<CallHeader> headers_;          // every rank's, by rank, after an exchange
  std::optional<Riding> riding_;
  Tensor scratch_;
};

}  // namespace

std::unique_ptr<Backend> create_hierarchical_backend(CallSite& site, const ProcessGroupOptions& options,
                                                     const std::string& prefix, const HostLayout& layout,
                                                     const BackendEntry& local, const BackendEntry& cross) {
  return std::make_unique<HierarchicalBackend>(site, options, prefix, layout, local, cross);
}

}  // namespace dparallel::dist
