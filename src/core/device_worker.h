// One persistent worker thread per device, created on first use (and again
// after stop_device_workers). Work
// submitted to a device's worker runs with that device made current, in the
// order of submission.
//
// All submissions, to any device, fall into one global order: work submitted
// together by run_on_devices enters every device's queue at the same point of
// that order. So if work waits only on work submitted in the same call, every
// call finishes, whatever its device order and whatever other threads submit
// at the same time (the earliest unfinished call always has all its work at
// the front of its queues). Work that waits on work of a later submission, or
// on its own device's worker, deadlocks.
#pragma once

#include <functional>
#include <future>
#include <vector>

#include "core/device.h"

namespace dparallel {

// Runs `work` on the worker thread of `device`, with the device made current
// just before it; the future carries its exception, if any, or the failure to
// make the device current (then `work` does not run).
std::future<void> run_on_device(const Device& device, std::function<void()> work);

// Runs works[i] on the worker of devices[i] as run_on_device does, all of
// them submitted at one point of the global order (see above). Throws, with
// nothing submitted, when a worker cannot be started.
std::vector<std::future<void>> run_on_devices(const std::vector<Device>& devices,
                                              std::vector<std::function<void()>> works);

// The device made current on this thread (cpu:0 on threads that are not
// device workers).
Device current_device();

// Ends every device worker once it has run what was queued (joins them);
// the next submission starts new ones. kState on a worker thread, which
// cannot join itself.
void stop_device_workers();

}  // namespace dparallel
