// GPU kernels: element-wise sums, casts and divisions, batched segment copies;
// events for the DDP reducer's waits on a host's stream.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <type_traits>
#include <vector>

#include "device/cuda/batched_copy_plan.h"
#include "device/cuda/copy_path.h"
#include "device/cuda/cuda_check.h"
#include "device/cuda/cuda_runtime.h"

namespace dparallel::cuda {

namespace {

constexpr int kThreads = 256;
constexpr size_t kMaxInputs = 8;  // inputs per kernel pass; more are folded in passes

template <typename T>
struct Accumulate {
  using Acc = T;
  __device__ static Acc load(T v) { return v; }
  __device__ static Acc add(Acc a, Acc b) { return a + b; }
  __device__ static T store(Acc v) { return v; }
};
template <>
struct Accumulate<__half> {
  using Acc = float;
  __device__ static Acc load(__half v) { return __half2float(v); }
  __device__ static Acc add(Acc a, Acc b) { return a + b; }
  __device__ static __half store(Acc v) { return __float2half_rn(v); }
};
template <>
struct Accumulate<__nv_bfloat16> {
  using Acc = float;
  __device__ static Acc load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static Acc add(Acc a, Acc b) { return a + b; }
  __device__ static __nv_bfloat16 store(Acc v) { return __float2bfloat16_rn(v); }
};
// Integers wrap through their unsigned type; bool is logical or.
template <>
struct Accumulate<int8_t> {
  using Acc = uint8_t;
  __device__ static Acc load(int8_t v) { return static_cast<uint8_t>(v); }
  __device__ static Acc add(Acc a, Acc b) { return static_cast<uint8_t>(a + b); }
  __device__ static int8_t store(Acc v) { return static_cast<int8_t>(v); }
};
template <>
struct Accumulate<int32_t> {
  using Acc = uint32_t;
  __device__ static Acc load(int32_t v) { return static_cast<uint32_t>(v); }
  __device__ static Acc add(Acc a, Acc b) { return a + b; }
  __device__ static int32_t store(Acc v) { return static_cast<int32_t>(v); }
};
template <>
struct Accumulate<int64_t> {
  using Acc = uint64_t;
  __device__ static Acc load(int64_t v) { return static_cast<uint64_t>(v); }
  __device__ static Acc add(Acc a, Acc b) { return a + b; }
  __device__ static int64_t store(Acc v) { return static_cast<int64_t>(v); }
};
struct BoolTag {};
template <>
struct Accumulate<BoolTag> {};

struct InputPointers {
  const void* ptr[kMaxInputs];
};

template <typename T>
__global__ void add_kernel(T* out, InputPointers inputs, int count, size_t numel) {
  using A = Accumulate<T>;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    typename A::Acc acc = A::load(static_cast<const T*>(inputs.ptr[0])[i]);
    for (int k = 1; k < count; ++k) acc = A::add(acc, A::load(static_cast<const T*>(inputs.ptr[k])[i]));
    out[i] = A::store(acc);
  }
}

__global__ void or_kernel(uint8_t* out, InputPointers inputs, int count, size_t numel) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    uint8_t any = 0;
    for (int k = 0; k < count; ++k) any |= static_cast<const uint8_t*>(inputs.ptr[k])[i];
    out[i] = any != 0 ? 1 : 0;
  }
}

unsigned grid_for(size_t numel) {
  size_t blocks = (numel + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 * 8 ? blocks : 65535 * 8);
}

template <typename T>
void launch_add(T* out, const InputPointers& inputs, int count, size_t numel, cudaStream_t stream) {
  add_kernel<T><<<grid_for(numel), kThreads, 0, stream>>>(out, inputs, count, numel);
}

void launch(DType dtype, void* out, const InputPointers& inputs, int count, size_t numel, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      return launch_add(static_cast<float*>(out), inputs, count, numel, stream);
    case DType::kFloat64:
      return launch_add(static_cast<double*>(out), inputs, count, numel, stream);
    case DType::kFloat16:
      return launch_add(static_cast<__half*>(out), inputs, count, numel, stream);
    case DType::kBFloat16:
      return launch_add(static_cast<__nv_bfloat16*>(out), inputs, count, numel, stream);
    case DType::kInt8:
      return launch_add(static_cast<int8_t*>(out), inputs, count, numel, stream);
    case DType::kUInt8:
      return launch_add(static_cast<uint8_t*>(out), inputs, count, numel, stream);
    case DType::kInt32:
      return launch_add(static_cast<int32_t*>(out), inputs, count, numel, stream);
    case DType::kInt64:
      return launch_add(static_cast<int64_t*>(out), inputs, count, numel, stream);
    case DType::kBool:
      or_kernel<<<grid_for(numel), kThreads, 0, stream>>>(static_cast<uint8_t*>(out), inputs, count, numel);
      return;
  }
}

// One block per chunk of the plan (batched_copy_plan.h), striding past the
// grid's limit: the byte head, whole words of W, the byte tail.
template <typename W>
__device__ void copy_chunk(const CopyChunk& c) {
  for (size_t b = threadIdx.x; b < c.head; b += blockDim.x) c.dst[b] = c.src[b];
  const size_t words = (c.nbytes - c.head) / sizeof(W);
  const W* src = reinterpret_cast<const W*>(c.src + c.head);
  W* dst = reinterpret_cast<W*>(c.dst + c.head);
  for (size_t w = threadIdx.x; w < words; w += blockDim.x) dst[w] = src[w];
  for (size_t b = c.head + words * sizeof(W) + threadIdx.x; b < c.nbytes; b += blockDim.x) c.dst[b] = c.src[b];
}

__global__ void batched_copy_kernel(const CopyChunk* chunks, size_t count) {
  for (size_t i = blockIdx.x; i < count; i += gridDim.x) {
    const CopyChunk c = chunks[i];
    switch (c.width) {
      case 16:
        copy_chunk<uint4>(c);
        break;
      case 8:
        copy_chunk<uint2>(c);
        break;
      case 4:
        copy_chunk<uint32_t>(c);
        break;
      case 2:
        copy_chunk<uint16_t>(c);
        break;
      default:
        copy_chunk<uint8_t>(c);
        break;
    }
  }
}

// Floating types through float (double through double), rounded once.
template <typename T>
struct Float {
  using Wide = float;
  __device__ static Wide load(T v) { return static_cast<Wide>(v); }
  __device__ static T store(Wide v) { return static_cast<T>(v); }
};
template <>
struct Float<double> {
  using Wide = double;
  __device__ static Wide load(double v) { return v; }
  __device__ static double store(Wide v) { return v; }
};
template <>
struct Float<__half> {
  using Wide = float;
  __device__ static Wide load(__half v) { return __half2float(v); }
  __device__ static __half store(Wide v) { return __float2half_rn(v); }
};
template <>
struct Float<__nv_bfloat16> {
  using Wide = float;
  __device__ static Wide load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(Wide v) { return __float2bfloat16_rn(v); }
};

template <typename D, typename S>
__global__ void cast_kernel(D* dst, const S* src, size_t numel) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    dst[i] = Float<D>::store(static_cast<typename Float<D>::Wide>(Float<S>::load(src[i])));
  }
}

template <typename T>
__global__ void divide_kernel(T* data, size_t numel, double divisor) {
  using W = typename Float<T>::Wide;
  const W d = static_cast<W>(divisor);
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < numel;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    data[i] = Float<T>::store(Float<T>::load(data[i]) / d);
  }
}

// Calls f(T*) with `data` as the floating type `dtype` names; false for other dtypes.
template <typename F>
bool with_float_type(DType dtype, void* data, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      f(static_cast<float*>(data));
      return true;
    case DType::kFloat64:
      f(static_cast<double*>(data));
      return true;
    case DType::kFloat16:
      f(static_cast<__half*>(data));
      return true;
    case DType::kBFloat16:
      f(static_cast<__nv_bfloat16*>(data));
      return true;
    default:
      return false;
  }
}

}  // namespace

void add_n(int32_t index, DType dtype, void* out, const void* const* inputs, size_t count, size_t numel) {
  if (numel == 0 || count == 0) return;
  DeviceGuard guard(index);
  cudaStream_t stream = stream_of(index);
  // Fold inputs in passes of kMaxInputs; after the first, `out` carries the
  // running sum. An input that is `out` itself goes in the first pass, which
  // reads each element before writing it; a later pass would read the sum.
  std::vector<const void*> order(inputs, inputs + count);
  std::stable_partition(order.begin(), order.end(), [out](const void* p) { return p == out; });
  size_t done = 0;
  while (done < count) {
    InputPointers batch{};
    int n = 0;
    if (done > 0) batch.ptr[n++] = out;
    while (done < count && n < static_cast<int>(kMaxInputs)) batch.ptr[n++] = order[done++];
    launch(dtype, out, batch, n, numel, stream);
    check(cudaGetLastError(), "add kernel launch");
  }
  finish_library_work(stream);
}

namespace {

// batched_copy's chunk table on a device's own library stream, kept and grown.
struct CopyTable {
  std::mutex mutex;
  void* data = nullptr;
  size_t bytes = 0;
};

CopyTable& copy_table(int32_t index) {
  static std::mutex mutex;
  // As long as the process, as the pool its tables come from.
  static auto* tables = new std::map<int32_t, std::unique_ptr<CopyTable>>();
  std::lock_guard<std::mutex> lock(mutex);
  std::unique_ptr<CopyTable>& table = (*tables)[index];
  if (table == nullptr) table = std::make_unique<CopyTable>();
  return *table;
}

}  // namespace

void batched_copy(int32_t index, const std::vector<Segment>& segments) {
  if (segments.empty()) return;
  DeviceGuard guard(index);
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, index), "cudaDeviceGetAttribute");
  // A few blocks per SM keep every SM busy while some wait on memory.
  const std::vector<CopyChunk> plan = plan_batched_copy(segments, static_cast<size_t>(sms) * 4);
  if (plan.empty()) return;
  cudaStream_t stream = stream_of(index);
  const size_t table_bytes = plan.size() * sizeof(CopyChunk);
  // The table goes to the GPU, then the kernel reads it, in stream order.
  auto upload_and_launch = [&](void* table) {
    cudaError_t status = cudaMemcpyAsync(table, plan.data(), table_bytes, cudaMemcpyHostToDevice, stream);
    if (status != cudaSuccess) return status;
    batched_copy_kernel<<<copy_grid(plan.size()), kThreads, 0, stream>>>(static_cast<CopyChunk*>(table), plan.size());
    return cudaGetLastError();
  };
  if (stream == device_stream_of(index)) {
    // The device's own stream keeps its table (a job's stream, which ends
    // with its job, allocates one per call). Locked from the upload to the
    // launch, so that another thread's upload queues after this launch.
    CopyTable& kept = copy_table(index);
    std::lock_guard<std::mutex> lock(kept.mutex);
    if (kept.bytes < table_bytes) {
      const size_t capacity = copy_table_capacity(table_bytes, kept.bytes);
      if (kept.data != nullptr) cudaFreeAsync(kept.data, stream);
      kept.data = nullptr;
      kept.bytes = 0;
      check(malloc_async(index, &kept.data, capacity, stream), "cudaMallocAsync");
      kept.bytes = capacity;
    }
    check(upload_and_launch(kept.data), "batched copy kernel");
  } else {
    void* table = nullptr;
    check(malloc_async(index, &table, table_bytes, stream), "cudaMallocAsync");
    const cudaError_t status = upload_and_launch(table);
    cudaFreeAsync(table, stream);
    check(status, "batched copy kernel");
  }
  finish_library_work(stream);
}

void cast(int32_t index, DType dst_dtype, void* dst, DType src_dtype, const void* src, size_t numel) {
  if (numel == 0) return;
  DeviceGuard guard(index);
  cudaStream_t stream = stream_of(index);
  bool launched = false;
  bool known = with_float_type(dst_dtype, dst, [&](auto* d) {
    launched = with_float_type(src_dtype, const_cast<void*>(src),
                               [&](auto* s) { cast_kernel<<<grid_for(numel), kThreads, 0, stream>>>(d, s, numel); });
  });
  if (!known || !launched) fail_invalid("cuda cast: only floating dtypes convert");
  check(cudaGetLastError(), "cast kernel launch");
  finish_library_work(stream);
}

void divide(int32_t index, DType dtype, void* data, size_t numel, int64_t divisor) {
  if (numel == 0) return;
  DeviceGuard guard(index);
  cudaStream_t stream = stream_of(index);
  bool known = with_float_type(dtype, data, [&](auto* d) {
    divide_kernel<<<grid_for(numel), kThreads, 0, stream>>>(d, numel, static_cast<double>(divisor));
  });
  if (!known) fail_invalid("cuda divide: only floating dtypes divide");
  check(cudaGetLastError(), "divide kernel launch");
  finish_library_work(stream);
}

void load_kernels(int32_t index) {
  static std::mutex mutex;
  static std::vector<bool> loaded;
  std::lock_guard<std::mutex> lock(mutex);
  if (loaded.empty()) loaded.assign(static_cast<size_t>(device_count()), false);
  if (index < 0 || static_cast<size_t>(index) >= loaded.size() || loaded[static_cast<size_t>(index)]) return;
  DeviceGuard guard(index);
  std::vector<const void*> kernels = {
      reinterpret_cast<const void*>(&add_kernel<float>),   reinterpret_cast<const void*>(&add_kernel<double>),
      reinterpret_cast<const void*>(&add_kernel<__half>),  reinterpret_cast<const void*>(&add_kernel<__nv_bfloat16>),
      reinterpret_cast<const void*>(&add_kernel<int8_t>),  reinterpret_cast<const void*>(&add_kernel<uint8_t>),
      reinterpret_cast<const void*>(&add_kernel<int32_t>), reinterpret_cast<const void*>(&add_kernel<int64_t>),
      reinterpret_cast<const void*>(&or_kernel),           reinterpret_cast<const void*>(&batched_copy_kernel)};
  // Every floating dtype pair the casts take, and each one's division.
  char probe = 0;
  for (DType d : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
    with_float_type(d, &probe, [&](auto* dst) {
      using D = std::remove_pointer_t<decltype(dst)>;
      kernels.push_back(reinterpret_cast<const void*>(&divide_kernel<D>));
      for (DType s : {DType::kFloat32, DType::kFloat64, DType::kFloat16, DType::kBFloat16}) {
        with_float_type(s, &probe, [&](auto* src) {
          using S = std::remove_pointer_t<decltype(src)>;
          kernels.push_back(reinterpret_cast<const void*>(&cast_kernel<D, S>));
        });
      }
    });
  }
  // cudaFuncGetAttributes loads a kernel, as CUDA's lazy-loading notes advise.
  for (const void* kernel : kernels) {
    cudaFuncAttributes attributes;
    check(cudaFuncGetAttributes(&attributes, kernel), "cudaFuncGetAttributes");
  }
  loaded[static_cast<size_t>(index)] = true;
}

}  // namespace dparallel::cuda
