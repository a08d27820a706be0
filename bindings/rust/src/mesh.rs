//! Device meshes (dp_device_mesh_*): a group's ranks as an n-dimensional
//! array with one group per dimension, PyTorch's init_device_mesh.

use std::fmt;
use std::ptr;

use crate::error::{cstring, owned_text};
use crate::{sys, Error, Library, ProcessGroup, Result};

/// A device mesh. Creating one is collective over the group; the groups of
/// its dimensions are borrowed from it (`group`), and dropping it leaves
/// them.
pub struct DeviceMesh {
    raw: *mut sys::dp_device_mesh,
    lib: Library,
    groups: Vec<(String, ProcessGroup)>,
}

unsafe impl Send for DeviceMesh {}
unsafe impl Sync for DeviceMesh {}

impl fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = self.groups.iter().map(|(name, _)| name.as_str()).collect();
        write!(f, "DeviceMesh({:?} over {:?})", self.shape().unwrap_or_default(), names)
    }
}

impl Drop for DeviceMesh {
    fn drop(&mut self) {
        // The borrowed groups go first: they are the mesh's.
        self.groups.clear();
        unsafe { (self.lib.api().device_mesh_destroy)(self.raw) };
    }
}

impl DeviceMesh {
    /// `group`'s ranks row-major over `shape` (its product the world size),
    /// the dimensions named `names` (empty: "dim0", "dim1", ...).
    pub fn new(group: &ProcessGroup, shape: &[i32], names: &[&str]) -> Result<DeviceMesh> {
        let lib = &group.lib;
        if !names.is_empty() && names.len() != shape.len() {
            return Err(Error::new(
                sys::DP_EINVAL,
                format!("argument 'names' has {} names for {} dimensions", names.len(), shape.len()),
            ));
        }
        let owned = names.iter().map(|n| cstring("names", n)).collect::<Result<Vec<_>>>()?;
        let raw_names: Vec<*const std::os::raw::c_char> = owned.iter().map(|n| n.as_ptr()).collect();
        let mut out = ptr::null_mut();
        lib.check(unsafe {
            (lib.api().device_mesh_create)(
                &mut out,
                group.raw,
                shape.as_ptr(),
                shape.len(),
                if names.is_empty() { ptr::null() } else { raw_names.as_ptr() },
            )
        })?;
        DeviceMesh::adopt(lib, out)
    }

    /// The 2-D mesh ("host", "local") of `group`'s hosts, one row per host.
    pub fn by_host(group: &ProcessGroup) -> Result<DeviceMesh> {
        let lib = &group.lib;
        let mut out = ptr::null_mut();
        lib.check(unsafe { (lib.api().device_mesh_create_by_host)(&mut out, group.raw) })?;
        DeviceMesh::adopt(lib, out)
    }

    fn adopt(lib: &Library, raw: *mut sys::dp_device_mesh) -> Result<DeviceMesh> {
        let mut mesh = DeviceMesh { raw, lib: lib.clone(), groups: Vec::new() };
        for dim in 0..mesh.ndim() {
            let mut name = ptr::null();
            lib.check(unsafe { (lib.api().device_mesh_dim_name)(raw, dim, &mut name) })?;
            let name = unsafe { owned_text(name) };
            let text = cstring("name", &name)?;
            let mut group = ptr::null_mut();
            lib.check(unsafe { (lib.api().device_mesh_group)(raw, text.as_ptr(), &mut group) })?;
            mesh.groups.push((name, ProcessGroup { raw: group, lib: lib.clone(), owned: false }));
        }
        Ok(mesh)
    }

    pub(crate) fn raw(&self) -> *const sys::dp_device_mesh {
        self.raw
    }

    pub fn ndim(&self) -> usize {
        unsafe { (self.lib.api().device_mesh_ndim)(self.raw) }
    }

    /// The extent of each dimension.
    pub fn shape(&self) -> Result<Vec<i32>> {
        let mut out = vec![0; self.ndim()];
        self.lib.check(unsafe { (self.lib.api().device_mesh_shape)(self.raw, out.as_mut_ptr(), out.len()) })?;
        Ok(out)
    }

    /// This rank's coordinate along each dimension (its rank in that
    /// dimension's group).
    pub fn coordinate(&self) -> Result<Vec<i32>> {
        let mut out = vec![0; self.ndim()];
        self.lib.check(unsafe { (self.lib.api().device_mesh_coordinate)(self.raw, out.as_mut_ptr(), out.len()) })?;
        Ok(out)
    }

    /// The dimensions' names, in order.
    pub fn dim_names(&self) -> Vec<&str> {
        self.groups.iter().map(|(name, _)| name.as_str()).collect()
    }

    /// The group of the dimension `name`, borrowed from the mesh.
    pub fn group(&self, name: &str) -> Result<&ProcessGroup> {
        if let Some((_, group)) = self.groups.iter().find(|(n, _)| n == name) {
            return Ok(group);
        }
        // The library's error names the dimension and lists the mesh's.
        let text = cstring("name", name)?;
        let mut group = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().device_mesh_group)(self.raw, text.as_ptr(), &mut group) })?;
        Err(Error::new(sys::DP_EINVAL, format!("argument 'name': the mesh has no dimension '{name}'")))
    }
}
