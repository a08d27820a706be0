#include "distributed/device_mesh.h"

#include <algorithm>

#include "core/error.h"

namespace dparallel::dist {

namespace {

// FNV-1a over `text`: what every rank's mesh arguments must agree on.
uint64_t fingerprint(const std::string& text) {
  uint64_t hash = 14695981039346656037ull;
  for (unsigned char c : text) {
    hash ^= c;
    hash *= 1099511628211ull;
  }
  return hash;
}

std::string describe_shape(const std::vector<int32_t>& shape) {
  std::string text;
  for (int32_t extent : shape) text += str_cat(text.empty() ? "" : "x", extent);
  return text;
}

const char* const kAgreementWhat = "mesh (shape and dimension names)";

}  // namespace

void check_mesh_arguments(const std::vector<int32_t>& shape, std::vector<std::string>& names, int32_t world_size) {
  if (shape.empty()) fail_invalid("argument 'ndim' is 0; a mesh has at least one dimension");
  int64_t ranks = 1;
  for (size_t d = 0; d < shape.size(); ++d) {
    if (shape[d] <= 0) {
      fail_invalid("argument 'shape': shape[", d, "] is ", shape[d], "; every extent must be > 0");
    }
    // Past the world size the product cannot come back to it: stop before it overflows.
    ranks = std::min<int64_t>(ranks * shape[d], int64_t{world_size} + 1);
  }
  if (ranks != world_size) {
    fail_invalid("argument 'shape' is ", describe_shape(shape), " (",
                 ranks > world_size ? str_cat("more than ", world_size) : std::to_string(ranks),
                 " ranks) but the group has ", world_size,
                 " ranks; the product of the extents must equal the world size");
  }
  if (names.empty()) {
    for (size_t d = 0; d < shape.size(); ++d) names.push_back(str_cat("dim", d));
  }
  if (names.size() != shape.size()) {
    fail_invalid("argument 'dim_names' has ", names.size(), " names for ", shape.size(), " dimensions");
  }
  for (size_t d = 0; d < names.size(); ++d) {
    if (names[d].empty()) fail_invalid("argument 'dim_names': dim_names[", d, "] is empty");
    for (size_t e = 0; e < d; ++e) {
      if (names[e] == names[d]) {
        fail_invalid("argument 'dim_names': dim_names[", d, "] '", names[d], "' repeats dim_names[", e,
                     "]; the names must be distinct");
      }
    }
  }
}

std::unique_ptr<DeviceMesh> DeviceMesh::create(ProcessGroup& group, const std::vector<int32_t>& shape,
                                               std::vector<std::string> names) {
  try {
    check_mesh_arguments(shape, names, group.size());
  } catch (const Error& e) {
    if (e.code() != StatusCode::kInvalidArgument) throw;
    group.refuse(CallKind::kAllGather, e.what(), false);
  }
  std::unique_ptr<DeviceMesh> mesh(new DeviceMesh());
  mesh->shape_ = shape;
  mesh->names_ = std::move(names);
  // Row-major: the last dimension varies fastest.
  std::vector<std::pair<int32_t, int32_t>> colors_keys(shape.size());
  int32_t stride = 1;
  for (size_t d = shape.size(); d-- > 0;) {
    const int32_t coordinate = group.rank() / stride % shape[d];
    // The linear index of the other coordinates, as the rank with this one 0.
    colors_keys[d] = {group.rank() - coordinate * stride, coordinate};
    stride *= shape[d];
  }
  std::string text = "shape " + describe_shape(shape) + " names";
  for (const std::string& name : mesh->names_) text += str_cat(" ", name.size(), ":", name);
  mesh->build(group, colors_keys, fingerprint(text));
  return mesh;
}

std::unique_ptr<DeviceMesh> DeviceMesh::create_by_host(ProcessGroup& group) {
  const std::vector<int32_t>& hosts = group.lineage().host_of_rank;
  const int32_t num_hosts = group.num_hosts();
  std::vector<int32_t> counts(static_cast<size_t>(num_hosts), 0);
  for (int32_t h : hosts) ++counts[static_cast<size_t>(h)];
  if (std::any_of(counts.begin(), counts.end(), [&](int32_t c) { return c != counts[0]; })) {
    std::string text;
    for (size_t h = 0; h < counts.size(); ++h) text += str_cat(text.empty() ? "" : ", ", "host ", h, ": ", counts[h]);
    fail_invalid("the group's ", num_hosts, " hosts run different numbers of its ranks (", text,
                 "); a mesh by host needs the same number on each");
  }
  std::unique_ptr<DeviceMesh> mesh(new DeviceMesh());
  mesh->shape_ = {num_hosts, counts[0]};
  mesh->names_ = {"host", "local"};
  const int32_t host = hosts[static_cast<size_t>(group.rank())];
  const int32_t local = group.local_rank();
  mesh->build(group, {{local, host}, {host, local}}, fingerprint("by host"));
  return mesh;
}

void DeviceMesh::build(ProcessGroup& group, const std::vector<std::pair<int32_t, int32_t>>& colors_keys,
                       uint64_t agreement) {
  SplitOptions options;
  options.timeout = group.timeout();
  options.device = group.device();
  for (const auto& [color, key] : colors_keys) {
    groups_.push_back(group.split(color, key, options, agreement, kAgreementWhat));
    coordinate_.push_back(groups_.back()->rank());
  }
}

size_t DeviceMesh::dim_index(const std::string& name) const {
  auto it = std::find(names_.begin(), names_.end(), name);
  if (it != names_.end()) return static_cast<size_t>(it - names_.begin());
  std::string known;
  for (const std::string& n : names_) known += str_cat(known.empty() ? "'" : ", '", n, "'");
  fail_invalid("argument 'dim_name' is '", name, "'; the mesh's dimensions are ", known);
}

}  // namespace dparallel::dist
