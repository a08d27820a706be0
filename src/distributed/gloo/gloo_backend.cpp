// The Gloo backend: Gloo's TCP transport and algorithms for cpu tensors.
//
// Before every collective the ranks exchange a fixed-size slab: a header
// (call_header.h: collective, dtype, element count, root, op, sequence
// number, whether the rank refused the call) and, for payloads up to
// kInlineBytes, the data itself. Headers that differ, or a refusal, are an
// error on every rank, so Gloo never sees mismatched sizes (its receive path
// enforces them on its own thread, which would abort the process). Small
// collectives finish within that one exchange: every rank reduces the slabs
// in rank order, so all get bitwise the same result.
//
// The slabs travel through Gloo's ring all-gather with buffers registered
// once (its lowest-latency path), on a context of their own: that path pins
// its sockets' send buffer to the message size, which would slow the large
// transfers on the main context (and the slab context's sockets are read
// synchronously, see the constructor). Two rings alternate, so a peer that is one
// collective ahead never writes into slabs this rank is still reading.
// Medium payloads (up to kMaxBlockBytes, while world size x block stays
// within kBlockBudget) take a second such all-gather in power-of-two block
// sizes instead of Gloo's per-call algorithms, whose handshakes cost more
// than the data at these sizes.
#include <gloo/allgather.h>
#include <gloo/allgather_ring.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/common/logging.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/address.h>
#include <gloo/transport/tcp/device.h>
#include <netinet/in.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "core/error.h"
#include "distributed/backend.h"
#include "distributed/call_header.h"
#include "distributed/reduce_ops.h"
#include "distributed/rendezvous.h"

namespace dparallel::dist {

namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kInlineBytes = 4096;
// How long a healthy group's destruction waits for the other ranks to leave.
constexpr Millis kLeaveBound{5000};
// How far past a collective's deadline its connections are closed.
constexpr Millis kWatchSlack{50};

constexpr size_t kSlabBytes = sizeof(CallHeader) + kInlineBytes;
constexpr size_t kMinBlockBytes = 8192;
constexpr size_t kMaxBlockBytes = 256 << 10;
constexpr size_t kBlockBudget = 1 << 20;
// Gloo's all-reduce cuts each rank's share into segments of at most 1 MiB by
// default. From 16 MiB per rank on, 8 MiB segments cut the time per op by
// about a quarter (2 ranks on loopback: 16 MiB 12.1 -> 8.7 ms, 64 MiB 44 ->
// 34 ms); below that they gained nothing measurable, so smaller payloads
// keep Gloo's default.
constexpr size_t kLargeSegmentFrom = 16 << 20;
constexpr size_t kLargeSegmentBytes = 8 << 20;
// A large reduce_scatter runs one all-to-all per segment of this many bytes
// of each rank's part. Against one all-to-all of everything, 8 MiB segments
// took 2-rank reduce_scatters of 64-128 MiB from about 0.97 to 0.82 of the
// former all-reduce's time; 1 MiB segments lost at 64 MiB.
constexpr size_t kScatterSegmentBytes = 8 << 20;

// Gloo's AllgatherRing sends its notifications from an int member that its
// constructor leaves uninitialised; built in zeroed memory, it sends zeros.
using Ring = gloo::AllgatherRing<uint8_t>;
struct RingDeleter {
  void operator()(Ring* ring) const {
    ring->~Ring();
    ::operator delete(ring);
  }
};
using RingPtr = std::unique_ptr<Ring, RingDeleter>;

RingPtr make_ring(const std::shared_ptr<gloo::Context>& context, const uint8_t* send, uint8_t* recv, int count) {
  void* memory = ::operator new(sizeof(Ring));
  std::memset(memory, 0, sizeof(Ring));
  try {
    return RingPtr(new (memory) Ring(context, std::vector<const uint8_t*>{send}, recv, count));
  } catch (...) {
    ::operator delete(memory);
    throw;
  }
}

// An all-gather of fixed-size blocks over Gloo's ring with registered
// buffers; two rings alternate (see above). Its buffers are allocated when it
// is made, before a collective's header exchange; its rings, which take slots
// of the context, by connect() or the first run, after the exchange: ranks
// that passed different sizes make different exchanges, and the slots must
// stay in step across ranks.
class BlockExchange {
 public:
  BlockExchange(std::shared_ptr<gloo::Context> context, int32_t rank, int32_t size, size_t block_bytes)
      : context_(std::move(context)), rank_(rank), size_(size), block_bytes_(block_bytes), send_(block_bytes) {
    for (auto& r : recv_) r.resize(block_bytes * static_cast<size_t>(size));
  }

  void connect() {
    if (size_ == 1 || rings_[0] != nullptr) return;
    for (int i = 0; i < 2; ++i) {
      rings_[i] = make_ring(context_, send_.data(), recv_[i].data(), static_cast<int>(block_bytes_));
    }
  }

  size_t block_bytes() const { return block_bytes_; }
  uint8_t* send() { return send_.data(); }
  // Rank r's block of the last run.
  uint8_t* block(int32_t r) { return recv_[phase_].data() + block_bytes_ * static_cast<size_t>(r); }

  void run() {
    phase_ ^= 1;
    if (size_ == 1) {
      std::memcpy(block(rank_), send_.data(), block_bytes_);
      return;
    }
    connect();
    rings_[phase_]->run();
  }

 private:
  std::shared_ptr<gloo::Context> context_;
  int32_t rank_;
  int32_t size_;
  size_t block_bytes_;
  std::vector<uint8_t> send_;
  std::vector<uint8_t> recv_[2];
  RingPtr rings_[2];
  int phase_ = 0;
};

// Gloo's TCP address: a sockaddr_storage that getsockname filled only as far
// as the address goes, the rest uninitialised stack memory, and a sequence
// number. Rewritten over a zeroed sockaddr_storage before it leaves.
class AddressBytes : public gloo::transport::tcp::Address {
 public:
  static constexpr size_t kSize = sizeof(Impl);

  static void zero_padding(char* bytes) {
    Impl impl;
    std::memcpy(&impl, bytes, kSize);
    size_t used = impl.ss.ss_family == AF_INET    ? sizeof(sockaddr_in)
                  : impl.ss.ss_family == AF_INET6 ? sizeof(sockaddr_in6)
                                                  : 0;
    if (used == 0) return;
    sockaddr_storage clean{};
    std::memcpy(&clean, &impl.ss, used);
    impl.ss = clean;
    std::memcpy(bytes, &impl, kSize);
  }
};

// Our store as Gloo's rendezvous store; every wait ends by the group's
// creation deadline, so creating all the meshes is bounded by one timeout.
class GlooStore : public gloo::rendezvous::Store {
 public:
  GlooStore(std::shared_ptr<dist::Store> store, Clock::time_point deadline)
      : store_(std::move(store)), deadline_(deadline) {}
  // Gloo sets one key per rank: the addresses of its pairs, one after another.
  void set(const std::string& key, const std::vector<char>& data) override {
    std::vector<char> value = data;
    if (value.size() % AddressBytes::kSize == 0) {
      for (size_t at = 0; at < value.size(); at += AddressBytes::kSize) AddressBytes::zero_padding(&value[at]);
    }
    store_->set(key, Bytes(value.begin(), value.end()));
    keys_set_.push_back(key);
  }
  // This rank's keys: once every mesh is connected, every peer has read them.
  const std::vector<std::string>& keys_set() const { return keys_set_; }
  std::vector<char> get(const std::string& key) override {
    Bytes value = store_->get(key, left_until(deadline_));
    return std::vector<char>(value.begin(), value.end());
  }
  void wait(const std::vector<std::string>& keys) override { store_->wait(keys, left_until(deadline_)); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    store_->wait(keys, std::min(timeout, left_until(deadline_)));
  }

 private:
  std::shared_ptr<dist::Store> store_;
  Clock::time_point deadline_;
  std::vector<std::string> keys_set_;
};

gloo::transport::tcp::attr transport_attr(const ProcessGroupOptions& options) {
  gloo::transport::tcp::attr attr;
  const char* ifname = std::getenv("DP_SOCKET_IFNAME");
  if (ifname != nullptr && *ifname != '\0') {
    attr.iface = ifname;
  } else {
    attr.hostname = advertised_host(options);
  }
  return attr;
}

// Gloo writes to sockets without MSG_NOSIGNAL: a peer's death would kill
// this process with SIGPIPE instead of failing the collective.
void ignore_sigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    struct sigaction ignore {};
    ignore.sa_handler = SIG_IGN;
    ::sigaction(SIGPIPE, &ignore, nullptr);
  }
}

class GlooBackend : public Backend {
 public:
  GlooBackend(CallSite& site, const ProcessGroupOptions& options) : Backend(site), store_(options.store) {
    ignore_sigpipe();
    auto deadline = Clock::now() + timeout();
    ReplyDeadlineCap cap(timeout());  // every store request of the creation ends by its deadline
    prefix_ = claim_key_prefix(store_, "pg");
    auto attr = transport_attr(options);
    try {
      device_ = gloo::transport::tcp::CreateDevice(attr);
      auto context = std::make_shared<gloo::rendezvous::Context>(rank(), size());
      context->setTimeout(timeout());
      GlooStore gloo_store(store_, deadline);
      gloo::rendezvous::PrefixStore prefixed(prefix_ + "gloo", gloo_store);
      context->connectFullMesh(prefixed, device_);
      context_ = context;
      if (size() > 1) {
        slab_context_ = connect(gloo_store, "gloo_slabs");
        block_context_ = connect(gloo_store, "gloo_blocks");
        // The slabs are read by the waiting thread itself, without a hand-off
        // through Gloo's event thread; they are small enough for the socket
        // buffers, so the blocking sends of this mode cannot stall.
        for (int32_t r = 0; r < size(); ++r) {
          if (r != rank()) slab_context_->getPair(r)->setSync(true, false);
        }
      }
      slabs_ = std::make_unique<BlockExchange>(slab_context_, rank(), size(), kSlabBytes);
      slabs_->connect();
      // A peer may still be reading them: a pair can connect before its
      // other end has read this rank's address. They go when the group does.
      rendezvous_keys_ = gloo_store.keys_set();
      if (size() > 1) watchdog_ = std::thread([this] { watch(); });
    } catch (const Error&) {
      throw;
    } catch (const gloo::IoException& e) {
      fail(StatusCode::kRemote, "connecting rank ", rank(), " to its ", size() - 1, " peers failed: ", e.what());
    } catch (const std::exception& e) {
      fail(StatusCode::kIo, "setting up Gloo on '", attr.iface.empty() ? attr.hostname : attr.iface,
           "' failed: ", e.what());
    }
  }

  ~GlooBackend() override {
    if (watchdog_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(watch_mutex_);
        watch_stop_ = true;
      }
      watch_cv_.notify_all();
      watchdog_.join();
    }
    if (size() > 1 && !broken()) wait_for_peers_to_leave();
  }

  const char* name() const override { return "gloo"; }

  void abort(const std::string& /*why*/) noexcept override { close_connections(); }

  BackendCapabilities capabilities() const override { return {}; }

  void all_reduce(const Tensor& tensor, ReduceOp op) override {
    size_t nbytes = tensor.nbytes();
    Call o = begin(CallKind::kAllReduce, tensor.dtype(), tensor.numel(), op, -1, nbytes, &tensor);
    size_t n = static_cast<size_t>(tensor.numel());
    ReduceFn fn = reduce_function(tensor.dtype(), op);
    if (gather_small(o, nbytes, [&](uint8_t* out) { copy_bytes(out, tensor.data(), nbytes); })) {
      copy_bytes(tensor.data(), gathered(0), nbytes);
      for (int32_t r = 1; r < size(); ++r) fn(tensor.data(), tensor.data(), gathered(r), n);
    } else {
      guarded(o, [&] {
        gloo::AllreduceOptions opts(context_);
        set_output(opts, tensor.data(), nbytes, tensor.element_size());
        opts.setReduceFunction(fn);
        opts.setTag(next_tag());
        opts.setTimeout(remaining(o));
        set_segment_size(opts, nbytes);
        gloo::allreduce(opts);
      });
    }
    if (op == ReduceOp::kAvg) divide_in_place(tensor.dtype(), tensor.data(), n, size());
  }

  void broadcast(const Tensor& tensor, int32_t root) override {
    size_t nbytes = tensor.nbytes();
    Call o = begin(CallKind::kBroadcast, tensor.dtype(), tensor.numel(), ReduceOp::kSum, root, nbytes, &tensor);
    auto fill = [&](uint8_t* out) {
      if (rank() == root) copy_bytes(out, tensor.data(), nbytes);
    };
    if (gather_small(o, nbytes, fill)) {
      if (rank() != root) copy_bytes(tensor.data(), gathered(root), nbytes);
      return;
    }
    guarded(o, [&] {
      gloo::BroadcastOptions opts(context_);
      opts.setOutput(static_cast<uint8_t*>(tensor.data()), nbytes);
      opts.setRoot(root);
      opts.setTag(next_tag());
      opts.setTimeout(remaining(o));
      gloo::broadcast(opts);
    });
  }

  void all_gather(const Tensor& input, const std::vector<Tensor>& outputs) override {
    size_t nbytes = input.nbytes();
    bool consecutive = true;
    auto* first = static_cast<uint8_t*>(outputs[0].data());
    for (int32_t r = 1; r < size(); ++r) {
      consecutive = consecutive && outputs[r].data() == first + nbytes * static_cast<size_t>(r);
    }
    auto* in = static_cast<const uint8_t*>(input.data());
    consecutive = consecutive && (in + nbytes <= first || in >= first + nbytes * static_cast<size_t>(size()));
    if (!consecutive && !fits_exchange(nbytes)) scratch(nbytes * static_cast<size_t>(size()));  // see begin()
    Call o = begin(CallKind::kAllGather, input.dtype(), input.numel(), ReduceOp::kSum, -1, nbytes, &input);
    if (gather_small(o, nbytes, [&](uint8_t* out) { copy_bytes(out, input.data(), nbytes); })) {
      for (int32_t r = 0; r < size(); ++r) copy_bytes(outputs[r].data(), gathered(r), nbytes);
      return;
    }
    // Outputs that are consecutive pieces of one buffer are gathered into in place.
    uint8_t* all = consecutive ? first : scratch_.data();
    guarded(o, [&] {
      gloo::AllgatherOptions opts(context_);
      opts.setInput(static_cast<uint8_t*>(input.data()), nbytes);
      opts.setOutput(all, nbytes * static_cast<size_t>(size()));
      opts.setTag(next_tag());
      opts.setTimeout(remaining(o));
      gloo::allgather(opts);
    });
    if (consecutive) return;
    for (int32_t r = 0; r < size(); ++r) copy_bytes(outputs[r].data(), all + nbytes * static_cast<size_t>(r), nbytes);
  }

  void reduce_scatter(const std::vector<Tensor>& inputs, const Tensor& output, ReduceOp op) override {
    size_t nbytes = output.nbytes();
    size_t n = static_cast<size_t>(output.numel());
    size_t total = nbytes * static_cast<size_t>(size());
    size_t mine = nbytes * static_cast<size_t>(rank());
    ReduceFn fn = reduce_function(output.dtype(), op);
    auto concatenate = [&](uint8_t* out) {
      for (int32_t r = 0; r < size(); ++r) copy_bytes(out + nbytes * static_cast<size_t>(r), inputs[r].data(), nbytes);
    };
    size_t segment = std::min(nbytes, kScatterSegmentBytes);
    if (!fits_exchange(total)) scratch(total + segment * static_cast<size_t>(size()));  // see begin()
    Call o = begin(CallKind::kReduceScatter, output.dtype(), output.numel(), op, -1, total, &output);
    if (gather_small(o, total, concatenate)) {
      copy_bytes(output.data(), gathered(0) + mine, nbytes);
      for (int32_t r = 1; r < size(); ++r) fn(output.data(), output.data(), gathered(r) + mine, n);
    } else {
      // Gloo's current API has no reduce-scatter: all-to-alls bring every
      // rank's part for this rank here, (size-1)/size of the concatenation
      // each way (an all-reduce of it moves twice that), and the parts are
      // reduced in rank order as above. One all-to-all per segment keeps
      // the received parts in cache for their reduction.
      const auto ranks = static_cast<size_t>(size());
      uint8_t* parts_out = scratch_.data();  // segment by segment: rank 0's piece, rank 1's...
      uint8_t* parts_in = parts_out + total;
      for (size_t offset = 0; offset < nbytes; offset += segment) {
        size_t len = std::min(segment, nbytes - offset);
        for (size_t r = 0; r < ranks; ++r) {
          std::memcpy(parts_out + offset * ranks + len * r, static_cast<const uint8_t*>(inputs[r].data()) + offset,
                      len);
        }
      }
      auto* out = static_cast<uint8_t*>(output.data());
      guarded(o, [&] {
        for (size_t offset = 0; offset < nbytes; offset += segment) {
          size_t len = std::min(segment, nbytes - offset);
          gloo::AlltoallOptions opts(context_);
          opts.setInput(parts_out + offset * ranks, len * ranks);
          opts.setOutput(parts_in, len * ranks);
          opts.setTag(next_tag());
          opts.setTimeout(remaining(o));
          gloo::alltoall(opts);
          size_t count = len / output.element_size();
          std::memcpy(out + offset, parts_in, len);
          for (size_t r = 1; r < ranks; ++r) fn(out + offset, out + offset, parts_in + len * r, count);
        }
      });
    }
    if (op == ReduceOp::kAvg) divide_in_place(output.dtype(), output.data(), n, size());
  }

  void barrier() override {
    Call o = begin(CallKind::kBarrier, DType::kUInt8, 0, ReduceOp::kSum, -1, 0, nullptr);
    exchange_headers(o);
  }

  // Swaps the header (and, for small payloads, the data gather_small put
  // beside it) with every rank.
  void swap_headers(Call& o) override {
    std::memcpy(slabs_->send(), &o.header, sizeof(CallHeader));
    guarded(o, [&] { slabs_->run(); });
  }

  // Rank r's header of the last exchange (the slabs are not aligned for CallHeader).
  CallHeader received_header(int32_t r) override {
    CallHeader h;
    std::memcpy(&h, slab(r), sizeof(CallHeader));
    return h;
  }

 private:
  // Another full mesh of connections on the same device.
  std::shared_ptr<gloo::Context> connect(GlooStore& gloo_store, const char* name) {
    auto context = std::make_shared<gloo::rendezvous::Context>(rank(), size());
    context->setTimeout(timeout());
    gloo::rendezvous::PrefixStore prefixed(prefix_ + name, gloo_store);
    context->connectFullMesh(prefixed, device_);
    return context;
  }

  // Starts a collective of `nbytes` per rank. What it may need is allocated
  // first: failing after the header exchange would leave the peers waiting.
  Call begin(CallKind kind, DType dtype, int64_t numel, ReduceOp op, int32_t root, size_t nbytes,
             const Tensor* tensor) {
    if (nbytes > kInlineBytes) blocks_for(nbytes);
    return begin_call(kind, dtype, numel, op, root, tensor);
  }

  // Rank r's slab of the last exchange.
  uint8_t* slab(int32_t r) { return slabs_->block(r); }

  // Checks the headers and, for payloads up to a block exchange's size,
  // swaps `nbytes` per rank that `fill` writes into the outgoing buffer;
  // afterwards gathered(r) is rank r's payload. False (only the headers
  // swapped) when the payload needs Gloo's own algorithms.
  template <typename Fill>
  bool gather_small(Call& o, size_t nbytes, Fill&& fill) {
    if (nbytes <= kInlineBytes) {
      fill(payload(slabs_->send()));
      exchange_headers(o);
      gathered_from_ = slabs_.get();
      gathered_offset_ = sizeof(CallHeader);
      return true;
    }
    exchange_headers(o);
    BlockExchange* blocks = blocks_for(nbytes);  // made by begin()
    if (blocks == nullptr) return false;
    fill(blocks->send());
    guarded(o, [&] { blocks->run(); });
    gathered_from_ = blocks;
    gathered_offset_ = 0;
    return true;
  }
  uint8_t* gathered(int32_t r) { return gathered_from_->block(r) + gathered_offset_; }

  // The block exchange for `bytes` per rank, made on first use; null when
  // the payload is too large for one.
  BlockExchange* blocks_for(size_t bytes) {
    size_t block = block_size_for(bytes);
    if (block == 0) return nullptr;
    auto& exchange = blocks_[block];
    if (!exchange) exchange = std::make_unique<BlockExchange>(block_context_, rank(), size(), block);
    return exchange.get();
  }
  // The block size that carries `bytes` per rank; 0 when too large for one.
  size_t block_size_for(size_t bytes) const {
    size_t block = kMinBlockBytes;
    while (block < bytes) block *= 2;
    if (block > kMaxBlockBytes || block * static_cast<size_t>(size()) > kBlockBudget) return 0;
    return block;
  }
  // True when `bytes` per rank go through the slabs or a block exchange, not Gloo's algorithms.
  bool fits_exchange(size_t bytes) const { return bytes <= kInlineBytes || block_size_for(bytes) != 0; }
  static uint8_t* payload(uint8_t* slab) { return slab + sizeof(CallHeader); }

  // Closes the connections when a transfer runs past its collective's
  // deadline: a ring's steps each wait up to the full timeout otherwise.
  class Armed {
   public:
    Armed(GlooBackend& group, Clock::time_point deadline) : group_(group) {
      std::lock_guard<std::mutex> lock(group_.watch_mutex_);
      group_.watch_deadline_ = deadline + kWatchSlack;
      group_.watch_fired_ = false;
      group_.watch_cv_.notify_all();
    }
    bool fired() const {
      std::lock_guard<std::mutex> lock(group_.watch_mutex_);
      return group_.watch_fired_;
    }
    ~Armed() {
      std::lock_guard<std::mutex> lock(group_.watch_mutex_);
      group_.watch_deadline_ = Clock::time_point::max();
    }
    Armed(const Armed&) = delete;
    Armed& operator=(const Armed&) = delete;

   private:
    GlooBackend& group_;
  };

  void watch() {
    std::unique_lock<std::mutex> lock(watch_mutex_);
    while (!watch_stop_) {
      if (watch_deadline_ == Clock::time_point::max()) {
        watch_cv_.wait(lock);
      } else if (Clock::now() >= watch_deadline_) {
        watch_deadline_ = Clock::time_point::max();
        watch_fired_ = true;
        lock.unlock();
        close_connections();
        lock.lock();
      } else {
        watch_cv_.wait_until(lock, watch_deadline_);
      }
    }
  }

  uint8_t* scratch(size_t nbytes) {
    if (scratch_.size() < nbytes) scratch_.resize(nbytes);  // kept across calls: fresh pages cost more than the copy
    return scratch_.data();
  }

  uint32_t next_tag() { return tag_++; }

  // Rounded up: a Gloo wait that times out then ends at or past the deadline.
  std::chrono::milliseconds remaining(const Call& o) const {
    auto left = std::chrono::ceil<std::chrono::milliseconds>(o.deadline - Clock::now());
    return std::max(left, std::chrono::milliseconds(1));
  }

  static void set_segment_size(gloo::AllreduceOptions& opts, size_t nbytes) {
    if (nbytes >= kLargeSegmentFrom) opts.setMaxSegmentSize(kLargeSegmentBytes);
  }

  static void set_output(gloo::AllreduceOptions& opts, void* data, size_t nbytes, size_t element_size) {
    switch (element_size) {
      case 1:
        opts.setOutput(static_cast<uint8_t*>(data), nbytes);
        break;
      case 2:
        opts.setOutput(static_cast<uint16_t*>(data), nbytes / 2);
        break;
      case 4:
        opts.setOutput(static_cast<uint32_t*>(data), nbytes / 4);
        break;
      default:
        opts.setOutput(static_cast<uint64_t*>(data), nbytes / 8);
        break;
    }
  }

  // Runs a Gloo call; its failures become kTimeout or kRemote naming the
  // collective, the tensor and the ranks that did not report the failure.
  template <typename F>
  void guarded(const Call& o, F&& call) {
    std::string cause;
    bool timed_out = false;
    try {
      Armed armed(*this, o.deadline);
      call();
      if (!armed.fired()) return;
      cause = "the transfer ran past the collective's deadline";
      timed_out = true;
    } catch (const gloo::IoException& e) {
      cause = e.what();
    } catch (const Error&) {
      throw;
    } catch (const std::bad_alloc&) {
      // Peers are mid-transfer with this rank: fail them now, and this group for good.
      close_connections();
      mark_broken(
          str_cat(call_kind_name(o.header.kind), " of ", describe_call(o), ": out of memory during the transfer"));
      throw;
    } catch (const std::exception& e) {  // gloo::Exception and gloo::EnforceNotMet
      cause = e.what();
    }
    // Gloo's waits end at the deadline (see remaining()) and the watchdog's
    // just after it, so a failure from then on is the timeout.
    timed_out = timed_out || Clock::now() >= o.deadline;
    close_connections();
    fail_call(o, timed_out ? StatusCode::kTimeout : StatusCode::kRemote, "gloo: " + cause);
  }

  // A rank that closes its connections while a peer is still reading the
  // last collective's final message makes Gloo report that message's
  // connection as closed, even though the message arrived. So a healthy
  // group waits (boundedly) until every rank is leaving before closing.
  void wait_for_peers_to_leave() noexcept {
    try {
      Millis bound = std::min(timeout(), kLeaveBound);
      ReplyDeadlineCap cap(bound);
      std::string key = prefix_ + "leaving";
      store_->add(key, 1);
      if (!poll_until([&] { return parse_counter(store_->get(key, bound), key) >= size(); }, bound)) return;
      // Every rank is leaving, so every rank has read this one's addresses;
      // the last one past the wait removes both counters.
      forget_keys(*store_, rendezvous_keys_);
      std::string left = prefix_ + "left";
      if (store_->add(left, 1) == size()) forget_keys(*store_, {key, left});
    } catch (...) {
      // The store is gone (rank 0 left first) or slow: close anyway.
    }
  }

  // Closes every connection so that peers blocked on this rank fail now
  // rather than at their timeout; the group is unusable after a failure.
  void close_connections() noexcept {
    for (auto* context : {context_.get(), slab_context_.get(), block_context_.get()}) {
      try {
        if (context != nullptr) context->closeConnections();
      } catch (...) {
        // Already closed by the failure itself.
      }
    }
  }

  std::shared_ptr<Store> store_;
  std::vector<std::string> rendezvous_keys_;  // this rank's addresses in the store
  std::string prefix_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;
  uint32_t tag_ = 1;
  std::shared_ptr<gloo::Context> slab_context_;
  std::shared_ptr<gloo::Context> block_context_;
  std::unique_ptr<BlockExchange> slabs_;
  std::map<size_t, std::unique_ptr<BlockExchange>> blocks_;  // by block size
  BlockExchange* gathered_from_ = nullptr;
  size_t gathered_offset_ = 0;
  std::vector<uint8_t> scratch_;
  std::mutex watch_mutex_;
  std::condition_variable watch_cv_;
  Clock::time_point watch_deadline_ = Clock::time_point::max();
  bool watch_stop_ = false;
  bool watch_fired_ = false;  // the armed transfer's connections were closed
  std::thread watchdog_;
};

}  // namespace

std::unique_ptr<Backend> create_gloo_backend(CallSite& site, const ProcessGroupOptions& options) {
  return std::make_unique<GlooBackend>(site, options);
}

}  // namespace dparallel::dist
