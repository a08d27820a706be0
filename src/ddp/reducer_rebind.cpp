// dp_ddp_rebind: what a reducer hands on to the one that goes on over
// another process group.
#include "core/error.h"
#include "ddp/reducer.h"
#include "ddp/reducer_internal.h"

namespace dparallel::ddp {

ReducerOptions Reducer::options_for_rebind() const {
  ReducerOptions options = options_;
  // The buckets stay as they are: every rank has the same plan already.
  options.bucket_plan = plan_text();
  options.init_sync = true;
  options.argument_error.clear();
  return options;
}

bool Reducer::requires_sync() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return requires_sync_;
}

void Reducer::retire() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (retired_) detail::fail_retired();
  if (finishing_) detail::fail_finishing();
  // A broken reducer keeps the marks of the backward that failed: it is
  // what a rebind recovers from.
  if (any_mark_ && !broken_) {
    fail(StatusCode::kState,
         "a backward is in progress (parameters were marked ready); call dp_ddp_rebind between iterations, after "
         "dp_ddp_finish_backward (the dp_ddp goes on over its group)");
  }
  retired_ = true;
}

}  // namespace dparallel::ddp
