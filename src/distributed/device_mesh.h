// A device mesh (PyTorch's init_device_mesh): the ranks of a group laid out
// as an n-dimensional array, with one group per dimension, made by splitting
// the group (ProcessGroup::split) once per dimension in dimension order: the
// group of dimension d joins the ranks that differ only in their coordinate
// along d, ranked by it. Every rank of the group makes the mesh alike: its
// shape and names travel with each split, so ranks that pass different ones
// fail (kInvalidArgument) rather than wait for groups that never fill. The
// mesh needs the group it was made from only while it is made.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "distributed/process_group.h"

namespace dparallel::dist {

class DeviceMesh {
 public:
  // `group`'s ranks row-major over `shape` (each extent > 0, their product
  // the world size) with dimensions named `names` (distinct, non-empty; none
  // at all: "dim0", "dim1", ...). A bad shape or name refuses the first
  // split: every rank fails, the others naming this one, and `group` stays
  // usable.
  static std::unique_ptr<DeviceMesh> create(ProcessGroup& group, const std::vector<int32_t>& shape,
                                            std::vector<std::string> names);
  // The 2-D mesh ("host", "local"): coordinate (host, local rank), hosts in
  // the order of their lowest rank. kInvalidArgument naming the counts when
  // the hosts run different numbers of the group's ranks (every rank alike:
  // they learnt the same hosts when the group was made).
  static std::unique_ptr<DeviceMesh> create_by_host(ProcessGroup& group);

  size_t ndim() const { return shape_.size(); }
  const std::vector<int32_t>& shape() const { return shape_; }
  const std::vector<std::string>& names() const { return names_; }
  // This rank's coordinate along each dimension: its rank in that dimension's group.
  const std::vector<int32_t>& coordinate() const { return coordinate_; }
  const std::shared_ptr<ProcessGroup>& group(size_t dim) const { return groups_.at(dim); }
  // The dimension named `name`: kInvalidArgument naming it and listing the names.
  size_t dim_index(const std::string& name) const;

 private:
  DeviceMesh() = default;
  // One split of `group` per dimension: (color, key) of each, all with `agreement`.
  void build(ProcessGroup& group, const std::vector<std::pair<int32_t, int32_t>>& colors_keys, uint64_t agreement);

  std::vector<int32_t> shape_;
  std::vector<std::string> names_;
  std::vector<int32_t> coordinate_;
  std::vector<std::shared_ptr<ProcessGroup>> groups_;
};

// Checks a mesh's shape and names for a group of `world_size` ranks, filling
// in the default names; kInvalidArgument naming 'shape' or 'dim_names'.
void check_mesh_arguments(const std::vector<int32_t>& shape, std::vector<std::string>& names, int32_t world_size);

}  // namespace dparallel::dist
