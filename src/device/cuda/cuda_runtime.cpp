// Host-side CUDA runtime use: devices, memory, copies and streams.
#include "device/cuda/cuda_runtime.h"

#include <cudaTypedefs.h>
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "core/device_runtime.h"
#include "device/cuda/copy_path.h"
#include "device/cuda/cuda_check.h"
#include "device/cuda/cuda_streams.h"
#include "device/cuda/peer_access.h"
#include "device/cuda/pinned_host_cache.h"

namespace dparallel::cuda {

namespace {

struct Probe {
  int32_t count = 0;
  std::string reason;
};

const Probe& probe() {
  static const Probe result = [] {
    Probe p;
    int count = 0;
    cudaError_t status = cudaGetDeviceCount(&count);
    if (status != cudaSuccess) {
      cudaGetLastError();
      p.reason = std::string("no CUDA GPU can be used (cudaGetDeviceCount: ") + cudaGetErrorString(status) + ")";
      return p;
    }
    p.count = count;
    p.reason = count == 0 ? "no CUDA GPU is present" : "";
    return p;
  }();
  return result;
}

void require(int32_t index) {
  if (index < 0 || index >= device_count()) {
    fail(StatusCode::kDevice, "cuda:", index, " is not available: ",
         device_count() == 0 ? probe().reason : "only " + std::to_string(device_count()) + " GPU(s) are present");
  }
}

cudaMemcpyKind kind_of(const Device& dst, const Device& src) {
  if (dst.is_cuda() && src.is_cuda()) return cudaMemcpyDeviceToDevice;
  return dst.is_cuda() ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
}

// The GPU whose stream carries a copy: the destination's unless it is host memory.
int32_t copy_device(const Device& dst, const Device& src) { return dst.is_cuda() ? dst.index : src.index; }

// The widest pitch a 2-D copy on GPU `index` takes (cudaDevAttrMaxPitch).
size_t max_pitch(int32_t index) {
  int value = 0;
  check(cudaDeviceGetAttribute(&value, cudaDevAttrMaxPitch, index), "cudaDeviceGetAttribute");
  return static_cast<size_t>(value);
}

// A driver function by name, or null where the driver lacks it (or there is
// no driver): the runtime looks it up, so libcuda is never linked.
template <typename Function>
Function driver_function(const char* name) noexcept {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  // 12000: the newest version of the symbol that CUDA 12.0 has, the one the typedef names.
  cudaError_t rc = cudaGetDriverEntryPointByVersion(name, &function, 12000, cudaEnableDefault, &found);
#else
  cudaError_t rc = cudaGetDriverEntryPoint(name, &function, cudaEnableDefault, &found);
#endif
  if (rc != cudaSuccess || found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Function>(function);
}

// Maps GPU `owner`'s library pool for GPU `peer` as well. Only the
// library's own pool: the device's default pool (the stand-in) is the host's too.
void open_pool(int32_t owner, int32_t peer) {
  cudaMemPool_t pool = library_pool(owner);
  cudaMemPool_t default_pool = nullptr;
  if (cudaDeviceGetDefaultMemPool(&default_pool, owner) != cudaSuccess) cudaGetLastError();
  if (pool == nullptr || pool == default_pool) return;
  cudaMemAccessDesc access{};
  access.location.type = cudaMemLocationTypeDevice;
  access.location.id = peer;
  access.flags = cudaMemAccessFlagsProtReadWrite;
  const cudaError_t rc = cudaMemPoolSetAccess(pool, &access, 1);
  if (rc == cudaSuccess) return;
  cudaGetLastError();
  // The library's own copies still work (the driver moves them), but a kernel
  // on `peer` that reads this pool directly (NCCL's in-process path) would
  // fault far from here: say why, once per pair (the caller's table).
  std::fprintf(stderr, "dparallel: GPU %d cannot map GPU %d's memory pool (%s): kernels on GPU %d must not read it\n",
               peer, owner, cudaGetErrorString(rc), peer);
}

// Lets GPU `from`, the current device, reach `to`'s memory, its library
// pool's included, once per pair: copies between them then go over NVLink
// or PCIe instead of through the host.
void enable_peer_access(int32_t from, int32_t to) {
  static auto* table = new PeerAccessTable();  // lives as long as the process, as peer access does
  table->ensure(from, to, [](int32_t a, int32_t b) {
    int can = 0;
    check(cudaDeviceCanAccessPeer(&can, a, b), "cudaDeviceCanAccessPeer");
    if (can == 0) return false;
    cudaError_t rc = cudaDeviceEnablePeerAccess(b, 0);
    if (rc != cudaSuccess) {
      cudaGetLastError();
      // Already enabled (by the host, say) is success; another refusal (too
      // many peers) leaves the copies staged through the host, still correct.
      if (rc != cudaErrorPeerAccessAlreadyEnabled) return false;
    }
    open_pool(b, a);
    return true;
  });
}

// The driver's virtual memory management (VMM) calls, looked up as
// driver_function does: a range of addresses reserved once, physical
// memory mapped into it and unmapped again while the addresses stay.
struct Vmm {
  PFN_cuDeviceGet_v2000 device_get = driver_function<PFN_cuDeviceGet_v2000>("cuDeviceGet");
  PFN_cuDeviceGetAttribute_v2000 get_attribute =
      driver_function<PFN_cuDeviceGetAttribute_v2000>("cuDeviceGetAttribute");
  PFN_cuGetErrorString_v6000 error_string = driver_function<PFN_cuGetErrorString_v6000>("cuGetErrorString");
  PFN_cuMemGetAllocationGranularity_v10020 granularity =
      driver_function<PFN_cuMemGetAllocationGranularity_v10020>("cuMemGetAllocationGranularity");
  PFN_cuMemAddressReserve_v10020 address_reserve =
      driver_function<PFN_cuMemAddressReserve_v10020>("cuMemAddressReserve");
  PFN_cuMemAddressFree_v10020 address_free = driver_function<PFN_cuMemAddressFree_v10020>("cuMemAddressFree");
  PFN_cuMemCreate_v10020 create = driver_function<PFN_cuMemCreate_v10020>("cuMemCreate");
  PFN_cuMemRelease_v10020 release = driver_function<PFN_cuMemRelease_v10020>("cuMemRelease");
  PFN_cuMemMap_v10020 map = driver_function<PFN_cuMemMap_v10020>("cuMemMap");
  PFN_cuMemUnmap_v10020 unmap = driver_function<PFN_cuMemUnmap_v10020>("cuMemUnmap");
  PFN_cuMemSetAccess_v10020 set_access = driver_function<PFN_cuMemSetAccess_v10020>("cuMemSetAccess");

  bool complete() const {
    return device_get != nullptr && get_attribute != nullptr && granularity != nullptr && address_reserve != nullptr &&
           address_free != nullptr && create != nullptr && release != nullptr && map != nullptr && unmap != nullptr &&
           set_access != nullptr;
  }
  // kOutOfMemory for CUDA_ERROR_OUT_OF_MEMORY, else kDevice naming the call.
  void check(CUresult rc, const char* call, int32_t index) const {
    if (rc == CUDA_SUCCESS) return;
    const char* text = nullptr;
    if (error_string == nullptr || error_string(rc, &text) != CUDA_SUCCESS || text == nullptr) text = "unknown error";
    fail(rc == CUDA_ERROR_OUT_OF_MEMORY ? StatusCode::kOutOfMemory : StatusCode::kDevice, call, " on cuda:", index,
         " failed: ", text, " (CUresult ", static_cast<int>(rc), ")");
  }
};

const Vmm& vmm() {
  static const Vmm* table = new Vmm();  // lives as long as the process, as the driver does
  return *table;
}

// Physical memory on GPU `index` for a VMM mapping.
CUmemAllocationProp pinned_on(int32_t index) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = index;
  return prop;
}

// Whether GPU `index` (current) has VMM, as its attribute says; DP_CUDA_VMM=0
// turns it off (the fallback: memory kept at reshard).
bool vmm_supported(int32_t index) {
  static const bool disabled = [] {
    const char* v = std::getenv("DP_CUDA_VMM");
    return v != nullptr && std::string(v) == "0";
  }();
  const Vmm& v = vmm();
  if (disabled || !v.complete()) return false;
  CUdevice device = 0;
  int supported = 0;
  if (v.device_get(&device, index) != CUDA_SUCCESS) return false;
  if (v.get_attribute(&supported, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, device) != CUDA_SUCCESS) {
    return false;
  }
  return supported != 0;
}

}  // namespace

Known thread_has_context() noexcept {
  static const auto get_current = driver_function<PFN_cuCtxGetCurrent_v4000>("cuCtxGetCurrent");
  CUcontext context = nullptr;
  if (get_current == nullptr || get_current(&context) != CUDA_SUCCESS) return Known::kUnknown;
  return context != nullptr ? Known::kYes : Known::kNo;
}

Known primary_context_active(int32_t index) noexcept {
  static const auto get_state = driver_function<PFN_cuDevicePrimaryCtxGetState_v7000>("cuDevicePrimaryCtxGetState");
  unsigned flags = 0;
  int active = 0;
  // Runtime and driver number the visible devices alike.
  if (get_state == nullptr || get_state(static_cast<CUdevice>(index), &flags, &active) != CUDA_SUCCESS) {
    return Known::kUnknown;
  }
  return active != 0 ? Known::kYes : Known::kNo;
}

bool compiled() { return true; }

int32_t device_count() { return probe().count; }

const char* unavailable_reason() { return probe().reason.c_str(); }

cudaStream_t stream_of(int32_t index) {
  // A queued job's own stream (LibraryWorkStaysQueued) on its thread.
  if (void* own = library_stream_override(Device{DeviceType::kCuda, index})) return static_cast<cudaStream_t>(own);
  return device_stream_of(index);
}

namespace {

// One non-blocking stream per device, made on first use and kept.
cudaStream_t stream_in(std::vector<cudaStream_t>& streams, int32_t index) {
  if (streams.empty()) streams.assign(static_cast<size_t>(device_count()), nullptr);
  require(index);
  cudaStream_t& stream = streams[static_cast<size_t>(index)];
  if (stream == nullptr) {
    DeviceGuard guard(index);
    check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  }
  return stream;
}

// Where blocks go back to the pool: nothing else is ever queued there.
cudaStream_t free_stream_of(int32_t index) {
  static std::mutex mutex;
  static auto* streams = new std::vector<cudaStream_t>();  // as long as the process, as the pool
  std::lock_guard<std::mutex> lock(mutex);
  return stream_in(*streams, index);
}

}  // namespace

cudaStream_t device_stream_of(int32_t index) {
  static std::mutex mutex;
  static std::vector<cudaStream_t> streams;
  std::lock_guard<std::mutex> lock(mutex);
  return stream_in(streams, index);
}

cudaMemPool_t library_pool(int32_t index) {
  static std::mutex mutex;
  // Leaked on purpose, as the pools: tensors may be freed from static destructors of hosts.
  static auto* known = new std::vector<std::optional<cudaMemPool_t>>();  // nullopt: not asked yet
  std::lock_guard<std::mutex> lock(mutex);
  if (known->empty()) known->assign(static_cast<size_t>(device_count()), std::nullopt);
  if (index < 0 || static_cast<size_t>(index) >= known->size()) return nullptr;
  std::optional<cudaMemPool_t>& answer = (*known)[static_cast<size_t>(index)];
  if (!answer) {
    cudaMemPool_t pool = nullptr;
    int supported = 0;
    if (cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, index) != cudaSuccess) {
      cudaGetLastError();  // an answer (no pools), not an error for the next check
      supported = 0;
    }
    if (supported != 0) {
      cudaMemPoolProps props{};
      props.allocType = cudaMemAllocationTypePinned;
      props.location.type = cudaMemLocationTypeDevice;
      props.location.id = index;
      int internal_dependencies = 0;
      if (cudaMemPoolCreate(&pool, &props) != cudaSuccess ||
          cudaMemPoolSetAttribute(pool, cudaMemPoolReuseAllowInternalDependencies, &internal_dependencies) !=
              cudaSuccess) {
        cudaGetLastError();
        if (pool != nullptr) cudaMemPoolDestroy(pool);
        pool = nullptr;
        if (cudaDeviceGetDefaultMemPool(&pool, index) != cudaSuccess) {
          cudaGetLastError();
          pool = nullptr;
        }
      }
    }
    // Kept across synchronizations: at the default threshold (0) the pool
    // gives its memory back to the driver at every synchronize, and the next
    // allocation maps it again; PyTorch's async allocator keeps it too. Only
    // the library's own pool: the default one is the host's. A refusal
    // leaves the pool as it was, slower but correct.
    cudaMemPool_t default_pool = nullptr;
    if (pool != nullptr && cudaDeviceGetDefaultMemPool(&default_pool, index) != cudaSuccess) cudaGetLastError();
    uint64_t release_threshold = UINT64_MAX;
    if (pool != nullptr && pool != default_pool &&
        cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &release_threshold) != cudaSuccess) {
      cudaGetLastError();
    }
    answer = pool;  // kept for the process's life, as the default pool is
  }
  return *answer;
}

cudaError_t malloc_async(int32_t index, void** data, size_t nbytes, cudaStream_t stream) {
  cudaMemPool_t pool = library_pool(index);
  return pool != nullptr ? cudaMallocFromPoolAsync(data, nbytes, pool, stream) : cudaMallocAsync(data, nbytes, stream);
}

namespace {

PinnedHostCache& pinned_host_cache() {
  static auto* cache = new PinnedHostCache();  // as long as the process: its blocks are never freed
  return *cache;
}

}  // namespace

void* pinned_host_take(size_t nbytes) {
  return pinned_host_cache().take(nbytes, [](size_t bytes) {
    void* block = nullptr;
    check(cudaMallocHost(&block, bytes), "cudaMallocHost");
    return block;
  });
}

void pinned_host_give(void* block) noexcept {
  if (block != nullptr) pinned_host_cache().give(block);
}

void connect_peers(const std::vector<int32_t>& devices) {
  for (int32_t from : devices) {
    DeviceGuard guard(from);
    for (int32_t to : devices) {
      if (to != from) enable_peer_access(from, to);
    }
  }
}

namespace {

bool has_memory_pools(int32_t index) { return library_pool(index) != nullptr; }

class CudaRuntime final : public DeviceRuntime {
 public:
  int32_t device_count() const override { return cuda::device_count(); }
  const char* unavailable_reason() const override { return cuda::unavailable_reason(); }

  void set_device(int32_t index) const override {
    require(index);
    check(cudaSetDevice(index), "cudaSetDevice");
  }

  Allocation allocate(int32_t index, size_t nbytes) const override {
    require(index);
    DeviceGuard guard(index);
    void* data = nullptr;
    cudaError_t status = cudaSuccess;
    if (has_memory_pools(index)) {
      // Stream-ordered: freeing it later never waits for the whole device.
      cudaStream_t stream = stream_of(index);
      status = malloc_async(index, &data, nbytes, stream);
      // Usable from any stream once this returns; where the library's work
      // stays queued, from the library stream and streams that follow it.
      if (status == cudaSuccess && !library_work_stays_queued()) {
        status = cudaStreamSynchronize(stream);
        if (status != cudaSuccess) cudaFreeAsync(data, stream);
      }
    } else {
      status = cudaMalloc(&data, nbytes);
    }
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      fail(StatusCode::kOutOfMemory, "could not allocate ", nbytes, " bytes on cuda:", index);
    }
    check(status, "cudaMalloc");
    return {data, false};
  }

  void deallocate(int32_t index, void* data, size_t) const noexcept override {
    if (data == nullptr || index < 0 || index >= cuda::device_count()) return;
    DeviceGuard guard(index, std::nothrow);
    if (!guard.ok()) return;  // the device is unusable, and its memory with it
    try {
      if (has_memory_pools(index)) {
        // The allocator hands a block here only once every stream that used
        // it has passed it, so it goes on a stream that waits for nothing:
        // the free is complete at once and any stream's next allocation may
        // reuse the memory without waiting for another stream. No
        // device-wide wait.
        if (cudaFreeAsync(data, free_stream_of(index)) != cudaSuccess) cudaGetLastError();
        return;
      }
    } catch (...) {
      // No library stream: free it the blocking way below.
    }
    if (cudaFree(data) != cudaSuccess) cudaGetLastError();
  }

  void fill_zero(int32_t index, void* data, size_t nbytes) const override {
    require(index);
    DeviceGuard guard(index);
    cudaStream_t stream = stream_of(index);
    check(cudaMemsetAsync(data, 0, nbytes, stream), "cudaMemsetAsync");
    finish_library_work(stream);
  }

  // VMM where the GPU has it: the range reserved once (cuMemAddressReserve),
  // one physical allocation of the whole range mapped in (cuMemCreate,
  // cuMemMap, cuMemSetAccess for this GPU and each peer that can reach it)
  // and unmapped and released at release_pages. Elsewhere the default: a
  // plain allocation that keeps its pages.
  PageReservation reserve_pages(int32_t index, size_t nbytes) const override {
    require(index);
    DeviceGuard guard(index);
    if (!vmm_supported(index)) return DeviceRuntime::reserve_pages(index, nbytes);
    const Vmm& v = vmm();
    const CUmemAllocationProp prop = pinned_on(index);
    size_t granularity = 0;
    v.check(v.granularity(&granularity, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity",
            index);
    if (granularity == 0) granularity = 1;
    PageReservation r;
    r.nbytes = nbytes;
    r.reserved = (nbytes + granularity - 1) / granularity * granularity;
    CUdeviceptr ptr = 0;
    v.check(v.address_reserve(&ptr, r.reserved, granularity, 0, 0), "cuMemAddressReserve", index);
    // The driver hands out device addresses as integers.
    r.data = reinterpret_cast<void*>(ptr);  // NOLINT(performance-no-int-to-ptr)
    r.releases = true;
    try {
      back_pages(index, r);
    } catch (...) {
      v.address_free(ptr, r.reserved);
      throw;
    }
    return r;
  }

  void back_pages(int32_t index, PageReservation& r) const override {
    if (r.backed) return;
    if (!r.releases) {
      r.backed = true;
      return;
    }
    require(index);
    DeviceGuard guard(index);
    const Vmm& v = vmm();
    const CUmemAllocationProp prop = pinned_on(index);
    const auto ptr = reinterpret_cast<CUdeviceptr>(r.data);
    CUmemGenericAllocationHandle handle = 0;
    v.check(v.create(&handle, r.reserved, &prop, 0), "cuMemCreate", index);
    const CUresult mapped = v.map(ptr, r.reserved, 0, handle, 0);
    if (mapped != CUDA_SUCCESS) {
      v.release(handle);
      v.check(mapped, "cuMemMap", index);
    }
    // A new mapping is reachable from no GPU until access is set: this one,
    // and the peers that may reach it (copies, NCCL's in-process path).
    std::vector<CUmemAccessDesc> access;
    for (int32_t peer = 0; peer < cuda::device_count(); ++peer) {
      int can = peer == index ? 1 : 0;
      if (peer != index && cudaDeviceCanAccessPeer(&can, peer, index) != cudaSuccess) {
        cudaGetLastError();
        can = 0;
      }
      if (can == 0) continue;
      CUmemAccessDesc desc{};
      desc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      desc.location.id = peer;
      desc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      access.push_back(desc);
    }
    const CUresult granted = v.set_access(ptr, r.reserved, access.data(), access.size());
    if (granted != CUDA_SUCCESS) {
      v.unmap(ptr, r.reserved);
      v.release(handle);
      v.check(granted, "cuMemSetAccess", index);
    }
    r.handle = handle;
    r.backed = true;
  }

  void release_pages(int32_t index, PageReservation& r) const noexcept override {
    if (!r.releases || !r.backed) return;
    DeviceGuard guard(index, std::nothrow);
    if (!guard.ok()) return;  // the device is unusable, and its memory with it
    const Vmm& v = vmm();
    // The physical memory goes once it is unmapped and its handle released.
    v.unmap(reinterpret_cast<CUdeviceptr>(r.data), r.reserved);
    v.release(static_cast<CUmemGenericAllocationHandle>(r.handle));
    r.handle = 0;
    r.backed = false;
  }

  void unreserve_pages(int32_t index, PageReservation& r) const noexcept override {
    if (r.data == nullptr) return;
    if (!r.releases) {
      DeviceRuntime::unreserve_pages(index, r);
      return;
    }
    release_pages(index, r);
    DeviceGuard guard(index, std::nothrow);
    if (guard.ok()) vmm().address_free(reinterpret_cast<CUdeviceptr>(r.data), r.reserved);
    r = PageReservation{};
  }

  void copy_rows(void* dst, const Device& dst_device, size_t dst_pitch, const void* src, const Device& src_device,
                 size_t src_pitch, size_t row_bytes, size_t rows) const override {
    if (row_bytes == 0 || rows == 0) return;
    if (dst_device.is_cuda()) require(dst_device.index);
    if (src_device.is_cuda()) require(src_device.index);
    int32_t index = copy_device(dst_device, src_device);
    DeviceGuard guard(index);
    cudaStream_t stream = stream_of(index);
    const CopyPath path = copy_path(rows, dst_pitch, src_pitch, row_bytes, max_pitch(index));
    if (dst_device.is_cuda() && src_device.is_cuda() && dst_device.index != src_device.index) {
      enable_peer_access(index, src_device.index);
      if (path != CopyPath::kPitched) {
        const size_t runs = path == CopyPath::kLinear ? 1 : rows;
        const size_t run_bytes = path == CopyPath::kLinear ? rows * row_bytes : row_bytes;
        for (size_t r = 0; r < runs; ++r) {
          check(cudaMemcpyPeerAsync(static_cast<char*>(dst) + r * dst_pitch, dst_device.index,
                                    static_cast<const char*>(src) + r * src_pitch, src_device.index, run_bytes, stream),
                "cudaMemcpyPeerAsync");
        }
      } else {
        // The peer form of a pitched copy: one slice of `rows` rows.
        cudaMemcpy3DPeerParms p{};
        p.srcPtr = cudaPitchedPtr{const_cast<void*>(src), src_pitch, row_bytes, rows};
        p.srcDevice = src_device.index;
        p.dstPtr = cudaPitchedPtr{dst, dst_pitch, row_bytes, rows};
        p.dstDevice = dst_device.index;
        p.extent = cudaExtent{row_bytes, rows, 1};
        check(cudaMemcpy3DPeerAsync(&p, stream), "cudaMemcpy3DPeerAsync");
      }
    } else if (path == CopyPath::kPitched) {
      check(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, rows, kind_of(dst_device, src_device), stream),
            "cudaMemcpy2DAsync");
    } else {
      const size_t runs = path == CopyPath::kLinear ? 1 : rows;
      const size_t run_bytes = path == CopyPath::kLinear ? rows * row_bytes : row_bytes;
      for (size_t r = 0; r < runs; ++r) {
        check(cudaMemcpyAsync(static_cast<char*>(dst) + r * dst_pitch, static_cast<const char*>(src) + r * src_pitch,
                              run_bytes, kind_of(dst_device, src_device), stream),
              "cudaMemcpyAsync");
      }
    }
    // Host memory and the other GPU's library stream are not ordered after
    // this stream: those copies are done when this returns.
    if (dst_device.is_cuda() && src_device.is_cuda() && dst_device.index == src_device.index) {
      finish_library_work(stream);
    } else {
      check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    }
  }

  bool library_work_is_queued() const override { return true; }
  bool default_stream_is_queued() const override { return true; }
  void* library_stream(int32_t index) const override { return stream_of(index); }
  void* create_stream(int32_t index) const override {
    require(index);
    return cuda::create_stream(index);
  }
  void destroy_stream(int32_t index, void* stream) const noexcept override { cuda::destroy_stream(index, stream); }
  void check_stream(int32_t index, void* stream, const char* argument) const override {
    require(index);
    cuda::check_stream(index, stream, argument);
  }
  void stream_synchronize(int32_t index, void* stream) const override { cuda::stream_synchronize(index, stream); }
  void launch_host_func(int32_t index, void* stream, std::function<void()> fn) const override {
    cuda::launch_host_func(index, stream, std::move(fn));
  }
  void* create_event(int32_t index) const override { return cuda::create_event(index); }
  void destroy_event(void* event) const noexcept override { cuda::destroy_event(event); }
  void record_event(void* event, int32_t index, void* stream) const override {
    cuda::record_event(event, index, stream);
  }
  void stream_wait_event(int32_t index, void* stream, void* event) const override {
    cuda::stream_wait_event(index, stream, event);
  }
  bool event_query(void* event) const override { return cuda::event_query(event); }
  void event_synchronize(void* event) const override { cuda::event_synchronize(event); }
};

}  // namespace

void register_runtime() {
  static const DeviceRuntime* runtime = new CudaRuntime();  // lives as long as the process
  register_device_runtime(DeviceType::kCuda, runtime);
}

}  // namespace dparallel::cuda
