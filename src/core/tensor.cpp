#include "core/tensor.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <limits>

#include "core/allocator.h"
#include "core/device_runtime.h"
#include "core/error.h"
#include "core/stream.h"

namespace dparallel {

std::string shape_string(const Shape& shape) {
  if (shape.empty()) return "scalar";
  std::string text;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i > 0) text += "x";
    text += std::to_string(shape[i]);
  }
  return text;
}

int64_t checked_numel(const Shape& shape, const char* argument) {
  int64_t numel = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) fail_invalid("argument '", argument, "[", i, "]' is ", shape[i], "; extents must be >= 0");
  }
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 0) return 0;
    if (numel > std::numeric_limits<int64_t>::max() / shape[i]) {
      fail_invalid("argument '", argument, "' (", shape_string(shape), ") has more elements than fit in int64");
    }
    numel *= shape[i];
  }
  return numel;
}

size_t checked_nbytes(DType dtype, const Shape& shape, const char* argument) {
  const int64_t numel = checked_numel(shape, argument);
  const size_t element = dtype_size(dtype);
  // Byte counts fit ptrdiff_t, as PyTorch's storage_max() requires, so that
  // pointer differences and int64 offsets over a tensor never overflow.
  constexpr auto kMaxBytes = static_cast<uint64_t>(std::numeric_limits<std::ptrdiff_t>::max());
  if (static_cast<uint64_t>(numel) > kMaxBytes / element) {
    fail_invalid("argument '", argument, "' (", shape_string(shape), ") holds ", numel, " ", dtype_name(dtype),
                 " elements of ", element, " bytes: more than PTRDIFF_MAX (", kMaxBytes, ") bytes");
  }
  return static_cast<size_t>(numel) * element;
}

std::shared_ptr<Storage> Storage::allocate(const Device& device, size_t nbytes, bool zero) {
  Allocation allocation = device_allocate(device, nbytes);
  auto storage = std::shared_ptr<Storage>(new Storage(device, allocation.data, nbytes, nullptr, true));
  if (zero && !allocation.zeroed) {
    fill_zero(allocation.data, device, nbytes);
  } else if (!zero && nbytes > 0 && device.is_cpu() && device_runtime(device.type).default_stream_is_queued()) {
    // The asynchronous cpu mode: whatever reads this before its producer
    // wrote it reads NaNs and all-ones integers, not zeros that may pass.
    std::memset(allocation.data, 0xff, nbytes);
  }
  return storage;
}

std::shared_ptr<Storage> Storage::wrap(const Device& device, void* data, size_t nbytes, Deleter deleter) {
  return std::shared_ptr<Storage>(new Storage(device, data, nbytes, std::move(deleter), false));
}

void Storage::record_use(std::shared_ptr<const Event> used) {
  if (used == nullptr) return;
  std::lock_guard<std::mutex> lock(uses_mutex_);
  // Uses already passed are dropped, so memory the host keeps for many
  // steps holds only those still in flight.
  uses_.erase(std::remove_if(uses_.begin(), uses_.end(),
                             [](const std::shared_ptr<const Event>& e) {
                               try {
                                 return e->query();
                               } catch (...) {
                                 return true;  // a failed device runs nothing more
                               }
                             }),
              uses_.end());
  uses_.push_back(std::move(used));
}

Storage::~Storage() {
  if (from_allocator_) {
    device_free(device_, data_, nbytes_, std::move(uses_));
  } else if (deleter_) {
    try {
      // The host's own memory goes back to it once the queued reads are done.
      for (const auto& used : uses_) used->synchronize();
    } catch (...) {
      // A failed device reads nothing more.
    }
    try {
      deleter_(data_);
    } catch (...) {
      // A host deleter that throws cannot be reported from a destructor.
    }
  }
}

Tensor Tensor::empty(DType dtype, const Shape& shape, const Device& device) {
  return wrap(Storage::allocate(device, checked_nbytes(dtype, shape, "shape"), false), 0, dtype, shape);
}

Tensor Tensor::zeros(DType dtype, const Shape& shape, const Device& device) {
  return wrap(Storage::allocate(device, checked_nbytes(dtype, shape, "shape"), true), 0, dtype, shape);
}

Tensor Tensor::wrap(std::shared_ptr<Storage> storage, size_t offset, DType dtype, const Shape& shape) {
  Tensor t;
  t.storage_ = std::move(storage);
  t.offset_ = offset;
  t.dtype_ = dtype;
  t.shape_ = shape;
  const size_t nbytes = checked_nbytes(dtype, shape, "shape");
  t.numel_ = checked_numel(shape, "shape");
  const size_t available = t.storage_->nbytes();
  if (offset > available || nbytes > available - offset) {
    fail(StatusCode::kInternal, "tensor view of ", nbytes, " bytes at offset ", offset, " exceeds its storage of ",
         available, " bytes");
  }
  return t;
}

void* Tensor::data() const {
  if (!storage_ || storage_->data() == nullptr) return nullptr;
  return static_cast<char*>(storage_->data()) + offset_;
}

Tensor Tensor::narrow_rows(int64_t start, int64_t length) const {
  if (shape_.empty() || start < 0 || length < 0 || start + length > shape_[0]) {
    fail(StatusCode::kInternal, "narrow_rows(", start, ", ", length, ") out of range for ", describe());
  }
  Shape shape = shape_;
  shape[0] = length;
  int64_t row = shape_[0] == 0 ? 0 : numel_ / shape_[0];
  return wrap(storage_, offset_ + static_cast<size_t>(start * row) * element_size(), dtype_, shape);
}

Tensor Tensor::view_at(size_t byte_offset, DType dtype, const Shape& shape) const {
  if (byte_offset > std::numeric_limits<size_t>::max() - offset_) {
    fail(StatusCode::kInternal, "view at byte offset ", byte_offset, " of ", describe(), " overflows size_t");
  }
  return wrap(storage_, offset_ + byte_offset, dtype, shape);
}

Tensor Tensor::view(const Shape& shape) const {
  if (checked_numel(shape, "shape") != numel_) {
    fail(StatusCode::kInternal, "view as ", shape_string(shape), " of ", describe());
  }
  return wrap(storage_, offset_, dtype_, shape);
}

Tensor Tensor::to(const Device& device) const {
  Tensor out = empty(dtype_, shape_, device);
  copy_tensor(out, *this);
  return out;
}

std::string Tensor::describe() const {
  return str_cat(dtype_name(dtype_), " ", shape_string(shape_), storage_ ? " on " + to_string(device()) : "");
}

void copy_bytes(void* dst, const Device& dst_device, const void* src, const Device& src_device, size_t nbytes) {
  if (nbytes == 0 || dst == src) return;
  copy_runtime(dst_device, src_device).copy_rows(dst, dst_device, nbytes, src, src_device, nbytes, nbytes, 1);
}

void copy_rows(void* dst, const Device& dst_device, size_t dst_pitch, const void* src, const Device& src_device,
               size_t src_pitch, size_t row_bytes, size_t rows) {
  copy_runtime(dst_device, src_device)
      .copy_rows(dst, dst_device, dst_pitch, src, src_device, src_pitch, row_bytes, rows);
}

void copy_tensor(const Tensor& dst, const Tensor& src) {
  if (dst.nbytes() != src.nbytes()) {
    fail(StatusCode::kInternal, "copy of ", src.describe(), " into ", dst.describe());
  }
  copy_bytes(dst.data(), dst.device(), src.data(), src.device(), src.nbytes());
}

void fill_zero(void* data, const Device& device, size_t nbytes) {
  if (nbytes == 0) return;
  device_runtime(device.type).fill_zero(device.index, data, nbytes);
}

}  // namespace dparallel
