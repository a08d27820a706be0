// dp_dist.h: device meshes, each a group per dimension of a process group.
#include <string>
#include <vector>

#include "capi/dist_internal.h"

using namespace dparallel;

namespace dparallel::capi {

const dp_device_mesh& mesh_arg(const dp_device_mesh* handle, const char* name) {
  if (handle == nullptr) null_argument(name);
  if (handle->tag != kMeshTag) fail_invalid("argument '", name, "' is not a dp_device_mesh handle");
  check_origin(handle->origin, name);
  return *handle;
}

}  // namespace dparallel::capi

namespace {

// The handle of a new mesh, lending a handle of each dimension's group.
dp_device_mesh* export_mesh(std::unique_ptr<dist::DeviceMesh> mesh) {
  auto handle = std::make_unique<dp_device_mesh>();
  for (size_t d = 0; d < mesh->ndim(); ++d) {
    auto group = std::make_unique<dp_process_group>();
    group->group = mesh->group(d);
    group->borrowed = true;
    handle->groups.push_back(std::move(group));
  }
  handle->mesh = std::move(mesh);
  return handle.release();
}

void check_cap(const dp_device_mesh& mesh, const int32_t* out, size_t cap) {
  capi::require_arg(out, "out");
  if (cap < mesh.mesh->ndim()) {
    fail_invalid("argument 'cap' is ", cap, " but the mesh has ", mesh.mesh->ndim(), " dimensions");
  }
}

}  // namespace

extern "C" {

dp_status dp_device_mesh_create(dp_device_mesh** out, dp_process_group* pg, const int32_t* shape, size_t ndim,
                                const char* const* dim_names) {
  DP_API_BEGIN
  if (out != nullptr) *out = nullptr;
  dist::ProcessGroup& group = capi::group_arg(pg, "pg");
  std::vector<int32_t> extents;
  std::vector<std::string> names;
  try {
    capi::require_arg(out, "out");
    if (ndim > 0) capi::require_arg(shape, "shape");
    extents.assign(shape, shape + ndim);
    for (size_t d = 0; dim_names != nullptr && d < ndim; ++d) {
      if (dim_names[d] == nullptr) fail_invalid("argument 'dim_names': dim_names[", d, "] is NULL");
      names.emplace_back(dim_names[d]);
    }
  } catch (const Error& e) {
    // Refused in the first split's place, so that the other ranks fail now too.
    group.refuse(dist::CallKind::kAllGather, e.what(), false);
  }
  *out = export_mesh(dist::DeviceMesh::create(group, extents, std::move(names)));
  DP_API_END
}

dp_status dp_device_mesh_create_by_host(dp_device_mesh** out, dp_process_group* pg) {
  DP_API_BEGIN
  if (out != nullptr) *out = nullptr;
  dist::ProcessGroup& group = capi::group_arg(pg, "pg");
  try {
    capi::require_arg(out, "out");
  } catch (const Error& e) {
    group.refuse(dist::CallKind::kAllGather, e.what(), false);
  }
  *out = export_mesh(dist::DeviceMesh::create_by_host(group));
  DP_API_END
}

size_t dp_device_mesh_ndim(const dp_device_mesh* mesh) {
  DP_API_BEGIN
  return capi::mesh_arg(mesh, "mesh").mesh->ndim();
  DP_API_END_VALUE(0)
}

dp_status dp_device_mesh_group(const dp_device_mesh* mesh, const char* dim_name, dp_process_group** out) {
  DP_API_BEGIN
  capi::clear_out(out, "out");
  const dp_device_mesh& m = capi::mesh_arg(mesh, "mesh");
  capi::require_arg(dim_name, "dim_name");
  *out = m.groups[m.mesh->dim_index(dim_name)].get();
  DP_API_END
}

void dp_device_mesh_destroy(dp_device_mesh* mesh) {
  if (mesh == nullptr || mesh->tag != kMeshTag || !mesh->origin.is_current()) return;
  mesh->tag = 0;
  try {
    delete mesh;
  } catch (...) {
    // Leaving the groups cannot fail in a way the caller could act on.
  }
}

dp_status dp_device_mesh_shape(const dp_device_mesh* mesh, int32_t* out, size_t cap) {
  DP_API_BEGIN
  const dp_device_mesh& m = capi::mesh_arg(mesh, "mesh");
  check_cap(m, out, cap);
  std::copy(m.mesh->shape().begin(), m.mesh->shape().end(), out);
  DP_API_END
}

dp_status dp_device_mesh_coordinate(const dp_device_mesh* mesh, int32_t* out, size_t cap) {
  DP_API_BEGIN
  const dp_device_mesh& m = capi::mesh_arg(mesh, "mesh");
  check_cap(m, out, cap);
  std::copy(m.mesh->coordinate().begin(), m.mesh->coordinate().end(), out);
  DP_API_END
}

dp_status dp_device_mesh_dim_name(const dp_device_mesh* mesh, size_t dim, const char** out) {
  DP_API_BEGIN
  capi::require_arg(out, "out");
  *out = nullptr;
  const dp_device_mesh& m = capi::mesh_arg(mesh, "mesh");
  if (dim >= m.mesh->ndim()) {
    fail_invalid("argument 'dim' is ", dim, " but the mesh has ", m.mesh->ndim(), " dimensions");
  }
  *out = m.mesh->names()[dim].c_str();
  DP_API_END
}

}  // extern "C"
