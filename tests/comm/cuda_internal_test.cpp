// In-process GPU collectives below the C ABI. Compiled always; each test
// skips cleanly without the GPUs it needs.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/comm.h"
#include "core/half.h"
#include "core/tensor.h"
#include "device/cuda/cuda_runtime.h"

namespace dparallel::comm {
namespace {

#define REQUIRE_GPUS(n) \
  if (cuda::device_count() < (n)) GTEST_SKIP() << "needs " << (n) << " GPU(s), found " << cuda::device_count()

Tensor filled(const std::vector<int32_t>& values, const Device& device) {
  Tensor host = Tensor::empty(DType::kInt32, {static_cast<int64_t>(values.size())}, Device{DeviceType::kCpu, 0});
  std::copy(values.begin(), values.end(), static_cast<int32_t*>(host.data()));
  return device.is_cpu() ? host : host.to(device);
}

std::vector<int32_t> read(const Tensor& t) {
  Tensor host = t.to(Device{DeviceType::kCpu, 0});
  const auto* p = static_cast<const int32_t*>(host.data());
  return std::vector<int32_t>(p, p + host.numel());
}

// Through NCCL (every device a distinct GPU, the source among them), an output
// on the source's GPU that is not the source itself must be written too.
TEST(CudaCommInternal, BroadcastIntoWritesAnOutputBesideTheSourceOnItsGpu) {
  REQUIRE_GPUS(2);
  const Device gpu0{DeviceType::kCuda, 0}, gpu1{DeviceType::kCuda, 1};
  Tensor source = filled({1, 2, 3, 4, 5}, gpu0);
  Tensor beside = filled({0, 0, 0, 0, 0}, gpu0);
  Tensor remote = filled({0, 0, 0, 0, 0}, gpu1);
  broadcast_into(source, {beside, remote});
  EXPECT_EQ(read(beside), (std::vector<int32_t>{1, 2, 3, 4, 5}));
  EXPECT_EQ(read(remote), (std::vector<int32_t>{1, 2, 3, 4, 5}));
}

const Device kHost{DeviceType::kCpu, 0};

std::vector<unsigned char> random_bytes(size_t n, unsigned seed) {
  std::vector<unsigned char> bytes(n);
  std::mt19937 rng(seed);
  for (auto& b : bytes) b = static_cast<unsigned char>(rng());
  return bytes;
}

Tensor bytes_on(const std::vector<unsigned char>& bytes, const Device& device) {
  Tensor host = Tensor::empty(DType::kUInt8, {static_cast<int64_t>(bytes.size())}, kHost);
  std::memcpy(host.data(), bytes.data(), bytes.size());
  return host.to(device);
}

std::vector<unsigned char> bytes_of(const Tensor& t) {
  Tensor host = t.to(kHost);
  const auto* p = static_cast<const unsigned char*>(host.data());
  return std::vector<unsigned char>(p, p + host.nbytes());
}

// Misaligned pairs (equal and unequal misalignment) of sizes from one byte
// to several chunks: every segment's bytes land, and nothing else changes.
TEST(CudaBatchedCopy, MisalignedSegmentsOfVaryingSizesCopyExactly) {
  REQUIRE_GPUS(1);
  const Device gpu{DeviceType::kCuda, 0};
  const size_t kSize = size_t{12} << 20;
  std::vector<unsigned char> src_bytes = random_bytes(kSize, 1), expected = random_bytes(kSize, 2);
  Tensor src = bytes_on(src_bytes, gpu), dst = bytes_on(expected, gpu);
  auto* dst_base = static_cast<char*>(dst.data());
  const auto* src_base = static_cast<const char*>(src.data());
  const size_t sizes[] = {
      1, 2, 3, 7, 15, 16, 17, 31, 100, 4095, 65536 + 3, (size_t{1} << 20) + 7, (size_t{3} << 20) + 1};
  const size_t dst_skews[] = {0, 1, 4, 8, 3};
  const size_t src_skews[] = {0, 1, 4, 2, 11};
  std::vector<cuda::Segment> segments;
  size_t dst_at = 0, src_at = 0;
  for (size_t nbytes : sizes) {
    for (size_t k = 0; k < 5; ++k) {
      size_t d = (dst_at + 15) / 16 * 16 + dst_skews[k];
      size_t s = (src_at + 15) / 16 * 16 + src_skews[k];
      if (d + nbytes > kSize || s + nbytes > kSize) break;
      segments.push_back({dst_base + d, src_base + s, nbytes});
      std::memcpy(expected.data() + d, src_bytes.data() + s, nbytes);
      dst_at = d + nbytes + 9;
      src_at = (s + nbytes + 13) % (kSize / 2);
    }
  }
  ASSERT_GT(segments.size(), 40u);
  cuda::batched_copy(0, segments);
  EXPECT_TRUE(bytes_of(dst) == expected);
}

// Seconds per call of f, the best of five after a warm-up.
template <typename F>
double best_seconds(F&& f) {
  f();
  double best = 1e30;
  for (int i = 0; i < 5; ++i) {
    auto start = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return best;
}

// One 64 MiB segment used to run on one block, one SM; planned in chunks it
// spreads over the GPU. tests/gpu/check.sh prints the GB/s line; the floors
// are loose (a quarter of a device-to-device memcpy aligned, a twentieth for
// byte copies) so that only a return to one block per segment fails.
TEST(CudaBatchedCopy, ThroughputOfMisalignedSegmentsNearsAMemcpy) {
  REQUIRE_GPUS(1);
  const Device gpu{DeviceType::kCuda, 0};
  const size_t kBytes = size_t{64} << 20;
  Tensor src = Tensor::zeros(DType::kUInt8, {static_cast<int64_t>(kBytes + 64)}, gpu);
  Tensor dst = Tensor::zeros(DType::kUInt8, {static_cast<int64_t>(kBytes + 64)}, gpu);
  auto* d = static_cast<char*>(dst.data());
  const auto* s = static_cast<const char*>(src.data());
  const double gb = static_cast<double>(kBytes) / 1e9;
  const double memcpy_rate = gb / best_seconds([&] { copy_bytes(d, gpu, s, gpu, kBytes); });
  struct Case {
    const char* name;
    size_t dst_offset, src_offset;
    double floor;
  };
  const Case cases[] = {{"aligned", 0, 0, 0.25},
                        {"same misalignment", 3, 3, 0.25},
                        {"8-byte skew", 0, 8, 0.25},
                        {"odd skew", 1, 0, 0.05}};
  std::string line = "batched copy of one 64 MiB segment, GB/s: memcpy " + std::to_string(memcpy_rate);
  for (const Case& c : cases) {
    std::vector<cuda::Segment> one{{d + c.dst_offset, s + c.src_offset, kBytes}};
    const double rate = gb / best_seconds([&] { cuda::batched_copy(0, one); });
    line += std::string(", ") + c.name + " " + std::to_string(rate);
    EXPECT_GE(rate, c.floor * memcpy_rate) << c.name;
  }
  std::printf("%s\n", line.c_str());
}

// A pitched block (rows apart by different pitches) from one GPU to another:
// the peer form of a 2-D copy.
TEST(CudaPitchedCopy, RowsCrossGpusWithTheirPitches) {
  REQUIRE_GPUS(2);
  const Device gpu0{DeviceType::kCuda, 0}, gpu1{DeviceType::kCuda, 1};
  const size_t rows = 37, row_bytes = 1001, src_pitch = 1536, dst_pitch = 1027;
  std::vector<unsigned char> src_bytes = random_bytes(rows * src_pitch, 3),
                             expected = random_bytes(rows * dst_pitch, 4);
  for (const auto& [from, to] : {std::pair{gpu0, gpu1}, std::pair{gpu1, gpu0}}) {
    Tensor src = bytes_on(src_bytes, from), dst = bytes_on(expected, to);
    std::vector<unsigned char> want = expected;
    for (size_t r = 0; r < rows; ++r) std::memcpy(&want[r * dst_pitch], &src_bytes[r * src_pitch], row_bytes);
    copy_rows(dst.data(), to, dst_pitch, src.data(), from, src_pitch, row_bytes, rows);
    EXPECT_TRUE(bytes_of(dst) == want) << to_string(from) << " to " << to_string(to);
  }
}

// add_n folds inputs in passes of eight: eleven inputs take two, in each
// dtype whose accumulation differs (float through float, wrapping ints, or).
Tensor typed_on(DType dtype, const std::vector<double>& values, const Device& device) {
  Tensor host = Tensor::empty(dtype, {static_cast<int64_t>(values.size())}, kHost);
  for (size_t i = 0; i < values.size(); ++i) {
    switch (dtype) {
      case DType::kFloat16:
        static_cast<uint16_t*>(host.data())[i] = float_to_half(static_cast<float>(values[i]));
        break;
      case DType::kBFloat16:
        static_cast<uint16_t*>(host.data())[i] = float_to_bfloat16(static_cast<float>(values[i]));
        break;
      case DType::kInt32:
        static_cast<int32_t*>(host.data())[i] = static_cast<int32_t>(values[i]);
        break;
      default:
        static_cast<uint8_t*>(host.data())[i] = values[i] != 0 ? 1 : 0;
        break;
    }
  }
  return host.to(device);
}

std::vector<double> typed_values(const Tensor& t) {
  Tensor host = t.to(kHost);
  std::vector<double> values(static_cast<size_t>(host.numel()));
  for (size_t i = 0; i < values.size(); ++i) {
    switch (t.dtype()) {
      case DType::kFloat16:
        values[i] = half_to_float(static_cast<const uint16_t*>(host.data())[i]);
        break;
      case DType::kBFloat16:
        values[i] = bfloat16_to_float(static_cast<const uint16_t*>(host.data())[i]);
        break;
      case DType::kInt32:
        values[i] = static_cast<const int32_t*>(host.data())[i];
        break;
      default:
        values[i] = static_cast<const uint8_t*>(host.data())[i];
        break;
    }
  }
  return values;
}

TEST(CudaAddN, MoreThanEightInputsInHalfBfloatInt32AndBool) {
  REQUIRE_GPUS(1);
  const Device gpu{DeviceType::kCuda, 0};
  const size_t kInputs = 11, kNumel = 3000;
  for (DType dtype : {DType::kFloat16, DType::kBFloat16, DType::kInt32, DType::kBool}) {
    std::vector<Tensor> inputs;
    std::vector<const void*> pointers;
    std::vector<double> want(kNumel, 0);
    for (size_t k = 0; k < kInputs; ++k) {
      std::vector<double> values(kNumel);
      for (size_t i = 0; i < kNumel; ++i) {
        // Small integers: exact in every dtype, so the sum is too (at most 11 * 7).
        // Bool: only the last input, beyond the first pass, has ones.
        values[i] = dtype == DType::kBool ? (k == kInputs - 1 && i % 3 == 0) : static_cast<double>((i + k) % 8);
        want[i] = dtype == DType::kBool ? (want[i] != 0 || values[i] != 0) : want[i] + values[i];
      }
      inputs.push_back(typed_on(dtype, values, gpu));
      pointers.push_back(inputs.back().data());
    }
    Tensor out = Tensor::empty(dtype, {static_cast<int64_t>(kNumel)}, gpu);
    cuda::add_n(0, dtype, out.data(), pointers.data(), pointers.size(), kNumel);
    EXPECT_EQ(typed_values(out), want) << dtype_name(dtype);
    // The output may be one of the inputs, even one past the first eight.
    cuda::add_n(0, dtype, inputs[kInputs - 1].data(), pointers.data(), pointers.size(), kNumel);
    EXPECT_EQ(typed_values(inputs[kInputs - 1]), want) << dtype_name(dtype) << " in place";
  }
}

// One copy of 2.5 GiB, host to GPU, GPU to GPU (same device) and back:
// a single row used to go through cudaMemcpy2DAsync with a pitch of its
// whole size, past the device's maximum pitch. Every byte is compared.
TEST(CudaLargeCopies, HostToGpuAndGpuToGpuOfTwoAndAHalfGiBCopyEveryByte) {
  REQUIRE_GPUS(1);
  const Device gpu{DeviceType::kCuda, 0};
  const size_t n = (size_t{5} << 30) / 2;
  Tensor host = Tensor::empty(DType::kUInt8, {static_cast<int64_t>(n)}, kHost);
  auto* h = static_cast<unsigned char*>(host.data());
  for (size_t i = 0; i < n; ++i) h[i] = static_cast<unsigned char>((i * 131 + (i >> 20)) % 251);
  Tensor on_gpu = host.to(gpu);
  Tensor second = Tensor::empty(DType::kUInt8, {static_cast<int64_t>(n)}, gpu);
  copy_bytes(second.data(), gpu, on_gpu.data(), gpu, n);
  Tensor back = second.to(kHost);
  EXPECT_EQ(std::memcmp(back.data(), host.data(), n), 0);
}

// Threads copying batches at once on the device's stream share its kept
// chunk table: each one's upload must queue after the other's launch.
TEST(CudaBatchedCopy, ThreadsSharingTheKeptTableEachCopyTheirOwnSegments) {
  REQUIRE_GPUS(1);
  const Device gpu{DeviceType::kCuda, 0};
  const size_t kSize = size_t{4} << 20;
  std::vector<std::thread> threads;
  std::vector<int> exact(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::vector<unsigned char> src_bytes = random_bytes(kSize, 10 + t);
      Tensor src = bytes_on(src_bytes, gpu), dst = bytes_on(std::vector<unsigned char>(kSize, 0), gpu);
      int good = 0;
      for (int round = 0; round < 20; ++round) {
        // A different number of segments each round, so the table grows too.
        const size_t pieces = 1 + static_cast<size_t>((round * 7 + t) % 60);
        const size_t piece = kSize / pieces;
        std::vector<cuda::Segment> segments;
        for (size_t k = 0; k < pieces; ++k) {
          segments.push_back(
              {static_cast<char*>(dst.data()) + k * piece, static_cast<const char*>(src.data()) + k * piece, piece});
        }
        cuda::batched_copy(0, segments);
        std::vector<unsigned char> got = bytes_of(dst);
        if (std::equal(got.begin(), got.begin() + static_cast<std::ptrdiff_t>(piece * pieces), src_bytes.begin())) {
          ++good;
        }
        cuda::batched_copy(0, {{dst.data(), dst.data(), 0}});  // nothing to copy: no table
        copy_bytes(dst.data(), gpu, bytes_on(std::vector<unsigned char>(kSize, 0), gpu).data(), gpu, kSize);
      }
      exact[static_cast<size_t>(t)] = good;
    });
  }
  for (std::thread& th : threads) th.join();
  EXPECT_EQ(exact, std::vector<int>(4, 20));
}

}  // namespace
}  // namespace dparallel::comm
