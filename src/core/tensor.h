// Tensors: a dtype, a shape and a byte range of a shared storage. Always
// contiguous row-major; views share the storage of what they came from.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"

namespace dparallel {

using Shape = std::vector<int64_t>;

constexpr int32_t kMaxNdim = 16;

class Event;

std::string shape_string(const Shape& shape);  // "2x3", "scalar" for ndim 0
// Elements of `shape`; throws kInvalidArgument (naming `argument`) for a
// negative extent or a product that overflows.
int64_t checked_numel(const Shape& shape, const char* argument);
// Bytes of a `dtype` tensor of `shape`: the one size computation every tensor
// goes through. Throws kInvalidArgument (naming `argument`) where
// checked_numel does, or when the byte count exceeds PTRDIFF_MAX.
size_t checked_nbytes(DType dtype, const Shape& shape, const char* argument);

class Storage {
 public:
  using Deleter = std::function<void(void*)>;

  // Memory from the device allocator; `zero` fills it with zeros.
  static std::shared_ptr<Storage> allocate(const Device& device, size_t nbytes, bool zero);
  // Memory owned elsewhere; `deleter` (may be empty) runs at destruction.
  static std::shared_ptr<Storage> wrap(const Device& device, void* data, size_t nbytes, Deleter deleter);

  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage();

  // Hands the deleter over once nothing can fail any more, so that a failed
  // wrap never runs it.
  void arm(Deleter& deleter) noexcept { deleter_.swap(deleter); }

  void* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  const Device& device() const { return device_; }

  // Work queued on a stream other than the one the last holder frees on
  // reads this memory until `used` completes: the allocator's free waits
  // for it too (PyTorch's record_stream), and a wrapped host buffer's
  // deleter runs only after it. For memory the host may still hold while a
  // queued job reads it. Thread-safe.
  void record_use(std::shared_ptr<const Event> used);

 private:
  Storage(const Device& device, void* data, size_t nbytes, Deleter deleter, bool from_allocator)
      : device_(device), data_(data), nbytes_(nbytes), deleter_(std::move(deleter)), from_allocator_(from_allocator) {}

  Device device_;
  void* data_;
  size_t nbytes_;
  Deleter deleter_;
  bool from_allocator_;
  std::mutex uses_mutex_;
  std::vector<std::shared_ptr<const Event>> uses_;  // record_use's, for the free
};

class Tensor {
 public:
  Tensor() = default;
  // Uninitialised contents.
  static Tensor empty(DType dtype, const Shape& shape, const Device& device);
  static Tensor zeros(DType dtype, const Shape& shape, const Device& device);
  // Throws kInvalidArgument when the shape's byte count overflows, kInternal
  // when those bytes at `offset` lie outside `storage`.
  static Tensor wrap(std::shared_ptr<Storage> storage, size_t offset, DType dtype, const Shape& shape);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int32_t ndim() const { return static_cast<int32_t>(shape_.size()); }
  int64_t numel() const { return numel_; }
  size_t element_size() const { return dtype_size(dtype_); }
  size_t nbytes() const { return static_cast<size_t>(numel_) * element_size(); }  // wrap checked it fits
  const Device& device() const { return storage_->device(); }
  void* data() const;
  const std::shared_ptr<Storage>& storage() const { return storage_; }
  size_t storage_offset() const { return offset_; }

  // Rows [start, start + length) along dim 0, sharing storage.
  Tensor narrow_rows(int64_t start, int64_t length) const;
  // A tensor of `shape` over bytes [offset, offset + its size) of this one's storage range.
  Tensor view_at(size_t byte_offset, DType dtype, const Shape& shape) const;
  // The same bytes seen with another shape of equal numel.
  Tensor view(const Shape& shape) const;
  // A new tensor with these contents on `device`.
  Tensor to(const Device& device) const;
  std::string describe() const;  // "float32 2x3 on cpu:0"

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;
  DType dtype_ = DType::kFloat32;
  Shape shape_;
  int64_t numel_ = 0;
};

// Copies nbytes between any two devices' memory (host copies use all cores).
void copy_bytes(void* dst, const Device& dst_device, const void* src, const Device& src_device, size_t nbytes);
// rows x row_bytes between any two devices, rows `pitch` bytes apart.
void copy_rows(void* dst, const Device& dst_device, size_t dst_pitch, const void* src, const Device& src_device,
               size_t src_pitch, size_t row_bytes, size_t rows);
void copy_tensor(const Tensor& dst, const Tensor& src);
void fill_zero(void* data, const Device& device, size_t nbytes);

}  // namespace dparallel
