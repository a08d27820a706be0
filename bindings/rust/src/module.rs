//! Module trees.

use std::fmt;
use std::os::raw::c_int;
use std::ptr;

use crate::error::{cstring, owned_text};
use crate::parallel::run_forward;
use crate::view::{note_grad_reached, pending_over, Access, CallAccess, DDP_MARKED};
use crate::{sys, Device, Error, Library, Replica, Result, Tensor, DP_EINVAL, DP_ESTATE};

/// A reference to a module tree (see dp_module.h). Methods taking `&self`
/// are the ones dp_module.h allows from several threads at once.
pub struct Module {
    pub(crate) raw: *mut sys::dp_module,
    pub(crate) lib: Library,
    pub(crate) owned: bool,
}

unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Drop for Module {
    fn drop(&mut self) {
        if self.owned {
            unsafe { (self.lib.api().module_destroy)(self.raw) };
        }
    }
}

impl fmt::Debug for Module {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Module({} parameters)", self.num_parameters())
    }
}

impl Module {
    /// A new, empty module.
    pub fn new(lib: &Library) -> Result<Module> {
        let mut out = ptr::null_mut();
        lib.check(unsafe { (lib.api().module_create)(&mut out) })?;
        Ok(Module { raw: out, lib: lib.clone(), owned: true })
    }

    /// Takes over an owned `dp_module*`.
    ///
    /// # Safety
    /// `raw` must be a valid module reference the caller owns.
    pub unsafe fn from_raw(lib: &Library, raw: *mut sys::dp_module) -> Module {
        Module { raw, lib: lib.clone(), owned: true }
    }

    pub fn as_raw(&self) -> *mut sys::dp_module {
        self.raw
    }

    pub fn library(&self) -> &Library {
        &self.lib
    }

    /// A new owned reference to this same module (handy inside a callback,
    /// whose replica is only lent).
    pub fn retain(&self) -> Result<Module> {
        Ok(self.submodule("")?.expect("a module is never a NULL slot of itself"))
    }

    pub fn register_parameter(&mut self, name: &str, value: &Tensor, requires_grad: bool) -> Result<()> {
        let c = cstring("name", name)?;
        let api = self.lib.api();
        self.lib
            .check(unsafe { (api.module_register_parameter)(self.raw, c.as_ptr(), value.raw, requires_grad as c_int) })
    }

    pub fn register_buffer(&mut self, name: &str, value: &Tensor, persistent: bool) -> Result<()> {
        let c = cstring("name", name)?;
        let api = self.lib.api();
        self.lib.check(unsafe { (api.module_register_buffer)(self.raw, c.as_ptr(), value.raw, persistent as c_int) })
    }

    pub fn register_module(&mut self, name: &str, child: &Module) -> Result<()> {
        let c = cstring("name", name)?;
        let api = self.lib.api();
        self.lib.check(unsafe { (api.module_register_module)(self.raw, c.as_ptr(), child.raw) })
    }

    pub fn num_parameters(&self) -> usize {
        unsafe { (self.lib.api().module_num_parameters)(self.raw) }
    }

    pub fn num_buffers(&self) -> usize {
        unsafe { (self.lib.api().module_num_buffers)(self.raw) }
    }

    /// The index-th parameter in listing order, with its dotted name.
    pub fn parameter_at(&self, index: usize) -> Result<(String, Tensor)> {
        let mut name = ptr::null();
        let mut out = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().module_parameter_at)(self.raw, index, &mut name, &mut out) })?;
        Ok((unsafe { owned_text(name) }, unsafe { Tensor::from_raw(&self.lib, out) }))
    }

    /// The index-th buffer in listing order, with its dotted name.
    pub fn buffer_at(&self, index: usize) -> Result<(String, Tensor)> {
        let mut name = ptr::null();
        let mut out = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().module_buffer_at)(self.raw, index, &mut name, &mut out) })?;
        Ok((unsafe { owned_text(name) }, unsafe { Tensor::from_raw(&self.lib, out) }))
    }

    /// Every buffer in listing order (dotted names).
    pub fn buffers(&self) -> Result<Vec<(String, Tensor)>> {
        (0..self.num_buffers()).map(|i| self.buffer_at(i)).collect()
    }

    /// Every parameter in listing order (dotted names).
    pub fn parameters(&self) -> Result<Vec<(String, Tensor)>> {
        (0..self.num_parameters()).map(|i| self.parameter_at(i)).collect()
    }

    /// The parameter by dotted name; `None` for a slot registered empty.
    pub fn get_parameter(&self, name: &str) -> Result<Option<Tensor>> {
        let c = cstring("dotted_name", name)?;
        let mut out = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().module_get_parameter)(self.raw, c.as_ptr(), &mut out) })?;
        Ok(if out.is_null() { None } else { Some(unsafe { Tensor::from_raw(&self.lib, out) }) })
    }

    /// The parameter by dotted name; an empty slot is DP_EINVAL.
    pub fn parameter(&self, name: &str) -> Result<Tensor> {
        self.get_parameter(name)?
            .ok_or_else(|| Error::new(DP_EINVAL, format!("dotted_name: parameter '{name}' is an empty slot")))
    }

    /// The buffer by dotted name; `None` for a slot registered empty.
    pub fn get_buffer(&self, name: &str) -> Result<Option<Tensor>> {
        let c = cstring("dotted_name", name)?;
        let mut out = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().module_get_buffer)(self.raw, c.as_ptr(), &mut out) })?;
        Ok(if out.is_null() { None } else { Some(unsafe { Tensor::from_raw(&self.lib, out) }) })
    }

    /// The child by dotted name ("" is the module itself).
    pub fn submodule(&self, name: &str) -> Result<Option<Module>> {
        let c = cstring("dotted_name", name)?;
        let mut out = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().module_get_module)(self.raw, c.as_ptr(), &mut out) })?;
        Ok(if out.is_null() { None } else { Some(unsafe { Module::from_raw(&self.lib, out) }) })
    }

    /// The parameter's gradient (allocated zeroed on first use, then the
    /// same storage every time).
    pub fn grad(&self, name: &str) -> Result<Tensor> {
        let c = cstring("dotted_name", name)?;
        let mut out = ptr::null_mut();
        self.lib.check(unsafe { (self.lib.api().module_grad)(self.raw, c.as_ptr(), &mut out) })?;
        self.note_grad_reached(name);
        Ok(unsafe { Tensor::from_raw(&self.lib, out) })
    }

    // Later calls on the tree check slices of this parameter's gradient.
    fn note_grad_reached(&self, name: &str) {
        if let Ok(Some(value)) = self.get_parameter(name) {
            note_grad_reached(unsafe { (self.lib.api().tensor_data)(value.raw) } as usize);
        }
    }

    /// The memory a call on this tree touches, one kind at a time.
    pub(crate) fn access(&self, parameters: Access, buffers: Access, grads: Access) -> CallAccess {
        let mut access = CallAccess::new();
        access.module(self, parameters, buffers, grads);
        access
    }

    /// Makes `grad` the parameter's gradient without copying: memory the
    /// host owns, e.g. `Tensor::from_vec` over its own gradient buffer, with
    /// the parameter's dtype, shape and device. The module keeps its own
    /// reference, so the memory lives as long as the module uses it (a
    /// vector is freed once the last tensor over it is gone). `None` drops
    /// the gradient (the next `grad` allocates zeros). Set it between
    /// backwards: while the current gradient is marked ready in a `Ddp`
    /// backward this is DP_ESTATE.
    pub fn set_grad(&mut self, name: &str, grad: Option<&Tensor>) -> Result<()> {
        let c = cstring("dotted_name", name)?;
        // A reduction in flight writes whichever gradient the parameter has
        // when it ends: one set meanwhile would be written under its slices.
        let mut current = ptr::null_mut();
        if unsafe { (self.lib.api().module_grad)(self.raw, c.as_ptr(), &mut current) } == sys::DP_OK
            && !current.is_null()
        {
            let current = unsafe { Tensor::from_raw(&self.lib, current) };
            if pending_over(current.data_ptr() as usize, current.nbytes(), DDP_MARKED) {
                return Err(Error::new(
                    DP_ESTATE,
                    format!("set_grad: parameter '{name}''s gradient: {}", DDP_MARKED.why),
                ));
            }
        }
        let raw = grad.map_or(ptr::null_mut(), |g| g.raw);
        self.lib.check(unsafe { (self.lib.api().module_set_grad)(self.raw, c.as_ptr(), raw) })?;
        if grad.is_some() {
            self.note_grad_reached(name);
        }
        Ok(())
    }

    pub fn zero_grad(&mut self) -> Result<()> {
        let _call = self.access(Access::Untouched, Access::Untouched, Access::Write).begin("zero_grad")?;
        self.lib.check(unsafe { (self.lib.api().module_zero_grad)(self.raw) })
    }

    pub fn set_requires_grad(&mut self, name: &str, requires_grad: bool) -> Result<()> {
        let c = cstring("dotted_name", name)?;
        let api = self.lib.api();
        self.lib.check(unsafe { (api.module_set_requires_grad)(self.raw, c.as_ptr(), requires_grad as c_int) })
    }

    pub fn requires_grad(&self, name: &str) -> Result<bool> {
        let c = cstring("dotted_name", name)?;
        let mut out: c_int = 0;
        self.lib.check(unsafe { (self.lib.api().module_requires_grad)(self.raw, c.as_ptr(), &mut out) })?;
        Ok(out != 0)
    }

    /// The state dict as a safetensors file.
    pub fn save(&self, path: &str) -> Result<()> {
        let c = cstring("path", path)?;
        let _call = self.access(Access::Read, Access::Read, Access::Untouched).begin("save")?;
        self.lib.check(unsafe { (self.lib.api().module_save)(self.raw, c.as_ptr()) })
    }

    pub fn load(&mut self, path: &str, strict: bool) -> Result<()> {
        let c = cstring("path", path)?;
        let _call = self.access(Access::Write, Access::Write, Access::Untouched).begin("load")?;
        self.lib.check(unsafe { (self.lib.api().module_load)(self.raw, c.as_ptr(), strict as c_int) })
    }

    /// A new replica on each device.
    pub fn replicate(&self, devices: &[Device], detach: bool) -> Result<Vec<Module>> {
        let mut out = vec![ptr::null_mut(); devices.len()];
        let raw_devices: Vec<sys::dp_device> = devices.iter().map(|d| d.0).collect();
        let api = self.lib.api();
        let _call = self.access(Access::Read, Access::Read, Access::Untouched).begin("replicate")?;
        self.lib.check(unsafe {
            (api.replicate)(self.raw, raw_devices.as_ptr(), raw_devices.len(), detach as c_int, out.as_mut_ptr())
        })?;
        Ok(out.into_iter().map(|m| unsafe { Module::from_raw(&self.lib, m) }).collect())
    }

    /// Adds every replica's gradients into this module's (dp_reduce_gradients).
    pub fn reduce_gradients_from(&mut self, replicas: &[&Module]) -> Result<()> {
        let raw: Vec<*mut sys::dp_module> = replicas.iter().map(|m| m.raw).collect();
        let mut access = self.access(Access::Untouched, Access::Untouched, Access::Write);
        for replica in replicas {
            access.module(replica, Access::Untouched, Access::Untouched, Access::Read);
        }
        let _call = access.begin("reduce_gradients_from")?;
        self.lib.check(unsafe { (self.lib.api().reduce_gradients)(raw.as_ptr(), raw.len(), self.raw) })
    }

    /// dp_data_parallel: scatter `input` along `dim` over `devices`, run
    /// `forward` on a replica per device, reduce the replicas' gradients into
    /// this module's and gather the outputs on `output_device`.
    pub fn data_parallel<F>(
        &mut self,
        input: &Tensor,
        devices: &[Device],
        output_device: Device,
        dim: i32,
        forward: F,
    ) -> Result<Tensor>
    where
        F: Fn(Replica<'_>) -> Result<Tensor> + Sync,
    {
        let raw_devices: Vec<sys::dp_device> = devices.iter().map(|d| d.0).collect();
        let mut access = self.access(Access::Read, Access::Read, Access::Write);
        let _call = access.tensor(&self.lib, input.raw, Access::Read).begin("data_parallel")?;
        let lib = self.lib.clone();
        let raw = self.raw;
        run_forward(&lib, &forward, |f, ud, out| unsafe {
            (lib.api().data_parallel)(
                raw,
                input.raw,
                raw_devices.as_ptr(),
                raw_devices.len(),
                output_device.0,
                dim,
                f,
                ud,
                out,
            )
        })
    }
}
