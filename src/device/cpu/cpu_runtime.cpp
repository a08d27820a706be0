#include "device/cpu/cpu_runtime.h"

#include <sys/mman.h>

#include "core/device_runtime.h"
#include "core/error.h"
#include "device/cpu/cpu_kernels.h"
#include "device/cpu/cpu_streams.h"

namespace dparallel::cpu {

namespace {

constexpr size_t kHugePage = size_t{2} << 20;

// cpu:i are logical devices over the one host memory: nothing to make current.
class CpuRuntime final : public DeviceRuntime {
 public:
  int32_t device_count() const override { return cpu_device_count(); }
  const char* unavailable_reason() const override { return ""; }
  void set_device(int32_t) const override {}

  // Fresh anonymous pages, known to be zero.
  Allocation allocate(int32_t, size_t nbytes) const override {
    void* p = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) fail(StatusCode::kOutOfMemory, "could not map ", nbytes, " bytes of host memory");
    // Fewer page faults and TLB misses for big buffers where the kernel allows it.
    if (nbytes >= kHugePage) madvise(p, nbytes, MADV_HUGEPAGE);
    return {p, true};
  }

  void deallocate(int32_t, void* data, size_t nbytes) const noexcept override { munmap(data, nbytes); }

  void fill_zero(int32_t, void* data, size_t nbytes) const override { parallel_zero(data, nbytes); }

  // Private anonymous pages: MADV_DONTNEED gives them back and later reads
  // fault in zero pages; no swap is reserved for them meanwhile.
  PageReservation reserve_pages(int32_t, size_t nbytes) const override {
    void* p = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) fail(StatusCode::kOutOfMemory, "could not reserve ", nbytes, " bytes of host memory");
    PageReservation r;
    r.data = p;
    r.nbytes = r.reserved = nbytes;
    r.releases = true;
    r.backed = true;
    return r;
  }
  void release_pages(int32_t, PageReservation& r) const noexcept override {
    if (r.data != nullptr && r.backed) madvise(r.data, r.reserved, MADV_DONTNEED);
    r.backed = false;
  }
  void back_pages(int32_t, PageReservation& r) const override { r.backed = true; }
  void unreserve_pages(int32_t, PageReservation& r) const noexcept override {
    if (r.data != nullptr) munmap(r.data, r.reserved);
    r = PageReservation{};
  }

  void copy_rows(void* dst, const Device&, size_t dst_pitch, const void* src, const Device&, size_t src_pitch,
                 size_t row_bytes, size_t rows) const override {
    cpu::copy_rows(dst, dst_pitch, src, src_pitch, row_bytes, rows);
  }

  bool library_work_is_queued() const override { return false; }
  bool default_stream_is_queued() const override { return async_mode(); }
  void* library_stream(int32_t) const override { return nullptr; }
  void* create_stream(int32_t index) const override { return cpu::create_stream(index); }
  void destroy_stream(int32_t, void* stream) const noexcept override { cpu::destroy_stream(stream); }
  void check_stream(int32_t index, void* stream, const char* argument) const override {
    cpu::check_stream(index, stream, argument);
  }
  void stream_synchronize(int32_t index, void* stream) const override { cpu::stream_synchronize(index, stream); }
  void launch_host_func(int32_t index, void* stream, std::function<void()> fn) const override {
    cpu::launch_host_func(index, stream, std::move(fn));
  }
  void* create_event(int32_t) const override { return cpu::create_event(); }
  void destroy_event(void* event) const noexcept override { cpu::destroy_event(event); }
  void record_event(void* event, int32_t index, void* stream) const override {
    cpu::record_event(event, index, stream);
  }
  void stream_wait_event(int32_t index, void* stream, void* event) const override {
    cpu::stream_wait_event(index, stream, event);
  }
  bool event_query(void* event) const override { return cpu::event_query(event); }
  void event_synchronize(void* event) const override { cpu::event_synchronize(event); }
};

}  // namespace

void register_runtime() {
  static const DeviceRuntime* runtime = new CpuRuntime();  // lives as long as the process
  register_device_runtime(DeviceType::kCpu, runtime);
}

}  // namespace dparallel::cpu
