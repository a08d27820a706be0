// One persistent worker thread per device, created on first use. Work
// submitted to a device's worker runs with that device current, in order.
#pragma once

#include <functional>
#include <future>

#include "core/device.h"

namespace dparallel {

// Runs `work` on the worker thread of `device`, with the device made current
// just before it; the future carries its exception, if any, or the failure to
// make the device current (then `work` does not run).
std::future<void> run_on_device(const Device& device, std::function<void()> work);

// The device made current on this thread (cpu:0 on threads that are not
// device workers).
Device current_device();

}  // namespace dparallel
