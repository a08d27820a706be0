#include <algorithm>

#include "comm/comm.h"
#include "core/error.h"

namespace dparallel::comm {

namespace {

struct Layout {
  size_t outer = 1;        // product of the extents before dim
  size_t inner_bytes = 0;  // bytes of one index along dim
};

// Only for a shape with at least one element, whose partial products are all
// bounded by its byte count (checked when the tensor was made). A zero-byte
// tensor copies nothing and needs no layout.
Layout layout_of(const Shape& shape, int32_t dim, size_t element_size) {
  Layout layout;
  size_t inner = 1;
  for (int32_t i = 0; i < dim; ++i) layout.outer *= static_cast<size_t>(shape[static_cast<size_t>(i)]);
  for (size_t i = static_cast<size_t>(dim) + 1; i < shape.size(); ++i) inner *= static_cast<size_t>(shape[i]);
  layout.inner_bytes = inner * element_size;
  return layout;
}

}  // namespace

std::vector<Tensor> scatter(const Tensor& tensor, const std::vector<Device>& devices,
                            const std::vector<int64_t>& chunk_sizes, int32_t dim) {
  if (devices.empty()) fail_invalid("argument 'devices' is empty: scatter needs at least one device");
  dim = wrap_dim(dim, tensor.ndim(), "dim");
  const int64_t extent = tensor.shape()[static_cast<size_t>(dim)];
  std::vector<int64_t> sizes;
  if (!chunk_sizes.empty()) {
    if (chunk_sizes.size() != devices.size()) {
      fail_invalid("expected devices and chunk_sizes of the same length, but got ", devices.size(), " devices and ",
                   chunk_sizes.size(), " chunk sizes");
    }
    int64_t total = 0;
    for (size_t i = 0; i < chunk_sizes.size(); ++i) {
      if (chunk_sizes[i] <= 0)
        fail_invalid("argument 'chunk_sizes[", i, "]' is ", chunk_sizes[i], "; chunk sizes must be positive");
      if (chunk_sizes[i] > extent) {
        fail_invalid("argument 'chunk_sizes[", i, "]' is ", chunk_sizes[i], ", larger than dimension ", dim, " (",
                     extent, ")");
      }
      if (__builtin_add_overflow(total, chunk_sizes[i], &total)) {
        fail_invalid("chunk sizes must sum to the size of dimension ", dim, " (", extent, "), but sum(chunk_sizes[0..",
                     i, "]) overflows int64");
      }
    }
    if (total != extent) {
      fail_invalid("chunk sizes must sum to the size of dimension ", dim, " (", extent, "), but sum(chunk_sizes) is ",
                   total);
    }
    sizes = chunk_sizes;
  } else if (extent == 0) {
    sizes.assign(devices.size(), 0);
  } else {
    const int64_t n = static_cast<int64_t>(devices.size());
    const int64_t split = extent / n + (extent % n != 0 ? 1 : 0);  // ceil without overflow
    for (int64_t start = 0; start < extent;) {
      const int64_t size = std::min(split, extent - start);
      sizes.push_back(size);
      start += size;
    }
  }
  const bool has_bytes = tensor.nbytes() > 0;
  const Layout layout = has_bytes ? layout_of(tensor.shape(), dim, tensor.element_size()) : Layout{};
  const size_t src_pitch = static_cast<size_t>(extent) * layout.inner_bytes;
  std::vector<Tensor> out;
  int64_t start = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    Shape shape = tensor.shape();
    shape[static_cast<size_t>(dim)] = sizes[i];
    // start <= extent: within the tensor's bytes when it has any, 0 when not.
    const size_t offset = static_cast<size_t>(start) * layout.inner_bytes;
    if (devices[i] == tensor.device() && (layout.outer == 1 || !has_bytes)) {
      out.push_back(tensor.view_at(offset, tensor.dtype(), shape));  // contiguous: a view, like torch
    } else {
      Tensor chunk = Tensor::empty(tensor.dtype(), shape, devices[i]);
      const size_t row = static_cast<size_t>(sizes[i]) * layout.inner_bytes;
      if (row > 0 && layout.outer > 0) {
        copy_rows(chunk.data(), devices[i], row, static_cast<const char*>(tensor.data()) + offset, tensor.device(),
                  src_pitch, row, layout.outer);
      }
      out.push_back(std::move(chunk));
    }
    start += sizes[i];
  }
  return out;
}

Tensor gather(const std::vector<Tensor>& tensors, int32_t dim, const Device& destination) {
  if (tensors.empty()) fail_invalid("argument 'tensors' is empty: gather needs at least one tensor");
  const Tensor& first = tensors[0];
  dim = wrap_dim(dim, first.ndim(), "dim");
  Shape shape = first.shape();
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    if (t.dtype() != first.dtype()) {
      fail_invalid("input ", i, " has dtype ", dtype_name(t.dtype()), ", but expected ", dtype_name(first.dtype()));
    }
    bool same_outside_dim = t.ndim() == first.ndim();
    for (int32_t k = 0; same_outside_dim && k < t.ndim(); ++k) {
      same_outside_dim = k == dim || t.shape()[static_cast<size_t>(k)] == first.shape()[static_cast<size_t>(k)];
    }
    if (!same_outside_dim) {
      fail_invalid("input ", i, " has invalid shape ", shape_string(t.shape()), ": it must equal input 0's (",
                   shape_string(first.shape()), ") in every dimension but dim ", dim);
    }
    if (__builtin_add_overflow(total, t.shape()[static_cast<size_t>(dim)], &total)) {
      fail_invalid("the inputs' extents along dim ", dim, " sum to more than int64 holds (at input ", i, ", ",
                   shape_string(t.shape()), ")");
    }
  }
  shape[static_cast<size_t>(dim)] = total;
  Tensor out = Tensor::empty(first.dtype(), shape, destination);
  if (out.nbytes() == 0) return out;
  const Layout layout = layout_of(shape, dim, first.element_size());
  const size_t dst_pitch = static_cast<size_t>(total) * layout.inner_bytes;
  size_t offset = 0;
  for (const Tensor& t : tensors) {
    const size_t row = static_cast<size_t>(t.shape()[static_cast<size_t>(dim)]) * layout.inner_bytes;
    if (row > 0 && layout.outer > 0) {
      copy_rows(static_cast<char*>(out.data()) + offset, destination, dst_pitch, t.data(), t.device(), row, row,
                layout.outer);
    }
    offset += row;
  }
  return out;
}

}  // namespace dparallel::comm
