// The MPI backend: the site's MPI library (mpi_library.h) moves the bytes.
//
// A group is a communicator of its own, made with MPI_Comm_create_group
// from the ranks' places in MPI_COMM_WORLD, which they swap through the
// store first (so subgroups work, and ranks that are not one MPI job are
// refused alike on every rank). Every collective swaps the call headers
// with MPI_Iallgather and then runs one non-blocking MPI collective; the
// calling thread polls it with MPI_Test until it completes or the
// collective's deadline passes. MPI cannot cancel a posted collective, so a
// timeout leaves it posted and breaks the group; a peer that died is seen
// only when the library reports it (most MPI runtimes end the whole job
// instead).
//
// float16 and bfloat16, which MPI has no types for, reduce as 16-bit
// integers through user-defined ops that compute in float32 and round
// (reduce_ops.h), as every other backend does; bool reduces as uint8 with
// max (sum, max) and min (prod, min).
#include <sched.h>

#include <atomic>
#include <climits>
#include <cstdio>
#include <mutex>
#include <thread>

#include "distributed/backend.h"
#include "distributed/mpi/mpi_library.h"
#include "distributed/reduce_ops.h"
#include "distributed/rendezvous.h"

namespace dparallel::dist {

namespace {

using Clock = std::chrono::steady_clock;

// MPI_Status is 20 bytes in MPICH, 24 in Open MPI: room for either.
struct StatusSpace {
  alignas(8) unsigned char bytes[64];
};

// The user-defined ops for float16 and bfloat16, one per (dtype, op), made once per process.
template <typename Handle>
struct HalfOps {
  Handle ops[2][5]{};  // [bfloat16?][ReduceOp]
  bool made = false;
};

template <DType D, ReduceOp Op, typename Handle>
void reduce_halves(void* in, void* inout, int* len, Handle* /*datatype*/) {
  reduce_function(D, Op)(inout, inout, in, static_cast<size_t>(*len));
}

template <typename Handle>
HalfOps<Handle>& half_ops() {
  static HalfOps<Handle> ops;
  return ops;
}

std::mutex& half_ops_mutex() {
  static std::mutex mutex;
  return mutex;
}

template <typename Handle, DType D>
void make_half_ops(const MpiApi<Handle>& api, Handle (&row)[5]) {
  api.op_create(&reduce_halves<D, ReduceOp::kSum, Handle>, 1, &row[static_cast<int>(ReduceOp::kSum)]);
  row[static_cast<int>(ReduceOp::kAvg)] = row[static_cast<int>(ReduceOp::kSum)];
  api.op_create(&reduce_halves<D, ReduceOp::kMin, Handle>, 1, &row[static_cast<int>(ReduceOp::kMin)]);
  api.op_create(&reduce_halves<D, ReduceOp::kMax, Handle>, 1, &row[static_cast<int>(ReduceOp::kMax)]);
  api.op_create(&reduce_halves<D, ReduceOp::kProd, Handle>, 1, &row[static_cast<int>(ReduceOp::kProd)]);
}

// FNV-1a of the group's key prefix: the tag MPI_Comm_create_group tells
// concurrent creations apart by (the same on every rank of the group).
int creation_tag(const std::string& prefix) {
  uint32_t hash = 2166136261u;
  for (char c : prefix) hash = (hash ^ static_cast<uint8_t>(c)) * 16777619u;
  return static_cast<int>(hash & 0x7fff);  // MPI_TAG_UB is at least 32767
}

// One rank's place in its MPI job, as it publishes it: "<flavor> <world rank> <world size>".
struct Place {
  int flavor = -1;
  int world_rank = -1;
  int world_size = -1;
};

template <typename Handle>
class MpiBackend final : public Backend {
 public:
  MpiBackend(CallSite& site, const ProcessGroupOptions& options, MpiLibrary& library, const MpiApi<Handle>& api)
      : Backend(site), library_(library), api_(api), headers_(static_cast<size_t>(size())) {
    comm_ = api_.comm_null;
    auto deadline = Clock::now() + timeout();
    std::vector<Place> places = swap_places(options, deadline);
    refuse_unless_one_job(places);
    std::vector<int> world_ranks;
    world_ranks.reserve(places.size());
    for (const Place& p : places) world_ranks.push_back(p.world_rank);
    {
      auto lock = library_.serialize();
      Handle world_group{};
      Handle group{};
      check(api_.comm_group(api_.comm_world, &world_group), "MPI_Comm_group");
      int rc = api_.group_incl(world_group, size(), world_ranks.data(), &group);
      api_.group_free(&world_group);
      check(rc, "MPI_Group_incl");
      // Blocks until every rank of the group calls it; they all passed the
      // store's rendezvous just before.
      rc = api_.comm_create_group(api_.comm_world, group, creation_tag(prefix_), &comm_);
      api_.group_free(&group);
      check(rc, "MPI_Comm_create_group");
      check(api_.comm_set_errhandler(comm_, api_.errors_return), "MPI_Comm_set_errhandler");
    }
    prepare_half_ops();
    library_.add_group();
  }

  ~MpiBackend() override {
    // A collective left posted (timeout, abort) keeps the communicator.
    if (!posted_ && comm_ != api_.comm_null) {
      auto lock = library_.serialize();
      api_.comm_free(&comm_);
    }
    library_.remove_group();
  }

  const char* name() const override { return "mpi"; }
  BackendCapabilities capabilities() const override { return {}; }

  void abort(const std::string& /*why*/) noexcept override { aborted_.store(true); }

  void swap_headers(Call& o) override {
    mine_ = o.header;
    run(o, "MPI_Iallgather (call headers)", [&](Handle* request) {
      return api_.iallgather(&mine_, static_cast<int>(sizeof(CallHeader)), api_.type_byte, headers_.data(),
                             static_cast<int>(sizeof(CallHeader)), api_.type_byte, comm_, request);
    });
  }

  CallHeader received_header(int32_t r) override { return headers_[static_cast<size_t>(r)]; }

  void all_reduce(const Tensor& tensor, ReduceOp op) override {
    Call o = begin_call(CallKind::kAllReduce, tensor.dtype(), tensor.numel(), op, -1, &tensor);
    exchange_headers(o);
    int count = checked_count(o, tensor.numel());
    if (count > 0) {
      Handle type = carrier_type(tensor.dtype());
      Handle mpi_op = reduction(tensor.dtype(), op);
      run(o, "MPI_Iallreduce", [&](Handle* request) {
        return api_.iallreduce(api_.in_place, tensor.data(), count, type, mpi_op, comm_, request);
      });
    }
    if (op == ReduceOp::kAvg) divide_in_place(tensor.dtype(), tensor.data(), static_cast<size_t>(count), size());
  }

  void broadcast(const Tensor& tensor, int32_t root) override {
    Call o = begin_call(CallKind::kBroadcast, tensor.dtype(), tensor.numel(), ReduceOp::kSum, root, &tensor);
    exchange_headers(o);
    int count = checked_count(o, static_cast<int64_t>(tensor.nbytes()));
    if (count == 0 || size() == 1) return;
    run(o, "MPI_Ibcast",
        [&](Handle* request) { return api_.ibcast(tensor.data(), count, api_.type_byte, root, comm_, request); });
  }

  void all_gather(const Tensor& input, const std::vector<Tensor>& outputs) override {
    const size_t nbytes = input.nbytes();
    const auto ranks = static_cast<size_t>(size());
    auto* first = static_cast<uint8_t*>(outputs[0].data());
    bool consecutive = true;
    for (size_t r = 1; r < ranks; ++r) consecutive = consecutive && outputs[r].data() == first + nbytes * r;
    auto* in = static_cast<const uint8_t*>(input.data());
    // Already in its place among consecutive outputs: MPI_IN_PLACE.
    const bool in_place = consecutive && in == first + nbytes * static_cast<size_t>(rank());
    const bool apart = in + nbytes <= first || in >= first + nbytes * ranks;
    const bool direct = consecutive && (in_place || apart);
    if (!direct) reserve_scratch(CallKind::kAllGather, "all_gather", nbytes * ranks);
    Call o = begin_call(CallKind::kAllGather, input.dtype(), input.numel(), ReduceOp::kSum, -1, &input);
    exchange_headers(o);
    int count = checked_count(o, static_cast<int64_t>(nbytes));
    if (count == 0) return;
    uint8_t* all = direct ? first : scratch_.data();
    const void* send = in_place ? api_.in_place : input.data();
    run(o, "MPI_Iallgather", [&](Handle* request) {
      return api_.iallgather(send, count, api_.type_byte, all, count, api_.type_byte, comm_, request);
    });
    if (direct) return;
    for (size_t r = 0; r < ranks; ++r) copy_bytes(outputs[r].data(), all + nbytes * r, nbytes);
  }

  void reduce_scatter(const std::vector<Tensor>& inputs, const Tensor& output, ReduceOp op) override {
    const size_t nbytes = output.nbytes();
    const auto ranks = static_cast<size_t>(size());
    auto* first = static_cast<const uint8_t*>(inputs[0].data());
    bool consecutive = true;
    for (size_t r = 1; r < ranks; ++r) consecutive = consecutive && inputs[r].data() == first + nbytes * r;
    auto* out = static_cast<const uint8_t*>(output.data());
    // MPI reads the inputs while it writes the output: they may not overlap.
    const bool direct = consecutive && (out + nbytes <= first || out >= first + nbytes * ranks);
    if (!direct) reserve_scratch(CallKind::kReduceScatter, "reduce_scatter", nbytes * ranks);
    Call o = begin_call(CallKind::kReduceScatter, output.dtype(), output.numel(), op, -1, &output);
    exchange_headers(o);
    int count = checked_count(o, output.numel());
    if (count == 0) return;
    const uint8_t* send = first;
    if (!direct) {
      for (size_t r = 0; r < ranks; ++r) copy_bytes(scratch_.data() + nbytes * r, inputs[r].data(), nbytes);
      send = scratch_.data();
    }
    Handle type = carrier_type(output.dtype());
    Handle mpi_op = reduction(output.dtype(), op);
    run(o, "MPI_Ireduce_scatter_block", [&](Handle* request) {
      return api_.ireduce_scatter_block(send, output.data(), count, type, mpi_op, comm_, request);
    });
    if (op == ReduceOp::kAvg) divide_in_place(output.dtype(), output.data(), static_cast<size_t>(count), size());
  }

  void barrier() override {
    Call o = begin_call(CallKind::kBarrier, DType::kUInt8, 0, ReduceOp::kSum, -1, nullptr);
    exchange_headers(o);
  }

 private:
  // Every rank's place in MPI_COMM_WORLD, through the store.
  std::vector<Place> swap_places(const ProcessGroupOptions& options, Clock::time_point deadline) {
    int world_rank = -1;
    int world_size = -1;
    {
      auto lock = library_.serialize();
      check(api_.comm_rank(api_.comm_world, &world_rank), "MPI_Comm_rank");
      check(api_.comm_size(api_.comm_world, &world_size), "MPI_Comm_size");
    }
    ReplyDeadlineCap cap(timeout());
    prefix_ = claim_key_prefix(options.store, "mpi");
    std::string mine = str_cat(static_cast<int>(library_.flavor()), " ", world_rank, " ", world_size);
    options.store->set(str_cat(prefix_, "place/", rank()), Bytes(mine.begin(), mine.end()));
    std::vector<Place> places;
    for (int32_t r = 0; r < size(); ++r) {
      std::string text = mine;
      if (r != rank()) {
        Bytes value = options.store->get(str_cat(prefix_, "place/", r), left_until(deadline));
        text.assign(value.begin(), value.end());
      }
      Place p;
      if (std::sscanf(text.c_str(), "%d %d %d", &p.flavor, &p.world_rank, &p.world_size) != 3) {
        fail(StatusCode::kRemote, "DP_BACKEND_MPI: rank ", r, " published a malformed MPI place '", text, "'");
      }
      places.push_back(p);
    }
    return places;
  }

  // The same verdict on every rank (all read the same places).
  void refuse_unless_one_job(const std::vector<Place>& places) {
    std::string problem;
    std::vector<bool> taken(static_cast<size_t>(std::max(places[0].world_size, 1)), false);
    for (size_t r = 0; r < places.size() && problem.empty(); ++r) {
      const Place& p = places[r];
      if (p.flavor != places[0].flavor) {
        problem = str_cat("rank ", r, " loaded another MPI implementation than rank 0");
      } else if (p.world_size != places[0].world_size || p.world_rank < 0 || p.world_rank >= p.world_size) {
        problem = str_cat("rank ", r, " is rank ", p.world_rank, " of an MPI world of ", p.world_size, ", rank 0 rank ",
                          places[0].world_rank, " of one of ", places[0].world_size);
      } else if (taken[static_cast<size_t>(p.world_rank)]) {
        problem = str_cat("rank ", r, " is MPI rank ", p.world_rank, " like another rank of the group");
      } else {
        taken[static_cast<size_t>(p.world_rank)] = true;
      }
    }
    if (problem.empty()) return;
    fail(StatusCode::kUnsupported, "DP_BACKEND_MPI: the ", size(), " ranks are not processes of one MPI job (", problem,
         "); start them with mpirun or mpiexec, one MPI process per rank");
  }

  void check(int rc, const char* what) const {
    if (rc != 0) fail(StatusCode::kRemote, "DP_BACKEND_MPI: ", what, " failed: ", library_.error_string(rc));
  }

  void prepare_half_ops() {
    std::lock_guard<std::mutex> lock(half_ops_mutex());
    HalfOps<Handle>& ops = half_ops<Handle>();
    if (ops.made) return;
    auto serial = library_.serialize();
    make_half_ops<Handle, DType::kFloat16>(api_, ops.ops[0]);
    make_half_ops<Handle, DType::kBFloat16>(api_, ops.ops[1]);
    ops.made = true;
  }

  // The MPI type a dtype's elements travel as.
  Handle carrier_type(DType dtype) const {
    switch (dtype) {
      case DType::kFloat32:
        return api_.type_float;
      case DType::kFloat64:
        return api_.type_double;
      case DType::kFloat16:
      case DType::kBFloat16:
        return api_.type_int16;
      case DType::kInt8:
        return api_.type_int8;
      case DType::kUInt8:
      case DType::kBool:
        return api_.type_uint8;
      case DType::kInt32:
        return api_.type_int32;
      case DType::kInt64:
        return api_.type_int64;
    }
    return api_.type_byte;
  }

  Handle reduction(DType dtype, ReduceOp op) const {
    if (dtype == DType::kFloat16 || dtype == DType::kBFloat16) {
      return half_ops<Handle>().ops[dtype == DType::kBFloat16 ? 1 : 0][static_cast<int>(op)];
    }
    if (dtype == DType::kBool) {
      return op == ReduceOp::kProd || op == ReduceOp::kMin ? api_.op_min : api_.op_max;
    }
    switch (op) {
      case ReduceOp::kSum:
      case ReduceOp::kAvg:
        return api_.op_sum;
      case ReduceOp::kMin:
        return api_.op_min;
      case ReduceOp::kMax:
        return api_.op_max;
      case ReduceOp::kProd:
        return api_.op_prod;
    }
    return api_.op_sum;
  }

  // MPI counts are ints; every rank's header says the same count, so every
  // rank refuses a larger one alike, before anything is sent.
  int checked_count(const Call& o, int64_t count) const {
    if (count > INT_MAX) {
      fail(StatusCode::kUnsupported, "DP_BACKEND_MPI: ", call_kind_name(o.header.kind), " of ", describe_call(o), ": ",
           count, " elements per call; MPI counts stop at ", INT_MAX);
    }
    return static_cast<int>(count);
  }

  // Scratch allocated before the header exchange; a failure refuses the call on every rank.
  void reserve_scratch(CallKind kind, const char* op, size_t bytes) {
    try {
      if (scratch_.size() < bytes) scratch_.resize(bytes);
    } catch (const std::bad_alloc&) {
      refuse_out_of_memory(kind, op, str_cat(bytes, " bytes of scratch"));
    }
  }

  // Posts a collective with `start` and polls it until it completes, the
  // collective's deadline passes or the group is aborted.
  template <typename Start>
  void run(const Call& o, const char* what, Start&& start) {
    Handle request = api_.request_null;
    int rc = 0;
    {
      auto lock = library_.serialize();
      rc = start(&request);
    }
    if (rc != 0) fail_call(o, StatusCode::kRemote, str_cat(what, " failed: ", library_.error_string(rc)));
    StatusSpace status{};
    for (uint64_t polls = 0;; ++polls) {
      int done = 0;
      {
        auto lock = library_.serialize();
        rc = api_.test(&request, &done, status.bytes);
      }
      if (rc != 0) {
        posted_ = true;
        fail_call(o, StatusCode::kRemote, str_cat(what, " failed: ", library_.error_string(rc)));
      }
      if (done != 0) return;
      if (aborted_.load()) {
        posted_ = true;
        fail_call(o, StatusCode::kRemote, str_cat(what, " was left posted: the group was aborted"));
      }
      if (Clock::now() >= o.deadline) {
        posted_ = true;
        fail_call(o, StatusCode::kTimeout,
                  str_cat(what,
                          " did not complete by the collective's deadline; MPI cannot cancel a posted "
                          "collective, so it stays posted and the group is unusable"));
      }
      // Spin while the peers are likely just behind; then make room for them
      // on shared cores. No sleeps: MPI's non-blocking collectives advance
      // only inside MPI_Test (sleeping 50 us between polls took a 64 MiB
      // all-reduce on 2 ranks from about 0.1 s to 2 s).
      if (polls > 2000) std::this_thread::yield();
    }
  }

  MpiLibrary& library_;
  const MpiApi<Handle>& api_;
  Handle comm_{};
  std::string prefix_;
  CallHeader mine_{};
  std::vector<CallHeader> headers_;
  std::vector<uint8_t> scratch_;
  std::atomic<bool> aborted_{false};
  bool posted_ = false;  // a collective stays posted on comm_
};

}  // namespace

std::unique_ptr<Backend> create_mpi_backend(CallSite& site, const ProcessGroupOptions& options) {
  MpiLibrary& library = MpiLibrary::get();
  if (library.flavor() == MpiFlavor::kOpenMpi) {
    return std::make_unique<MpiBackend<void*>>(site, options, library, library.open_mpi());
  }
  return std::make_unique<MpiBackend<int>>(site, options, library, library.mpich());
}

}  // namespace dparallel::dist
