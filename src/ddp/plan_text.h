// The bucket plan as text (dp_ddp_bucket_plan and the bucket_plan option):
// one line per bucket in launch order, "bucket <dtype> <name> <name> ...",
// under a header line. Names are percent-encoded where they hold spaces,
// control bytes or '%', so any name survives and common ones read as is.
#pragma once

#include <string>
#include <vector>

#include "core/dtype.h"

namespace dparallel::ddp {

struct PlanParam {
  std::string name;
  DType dtype;
};

// The plan's text; buckets[b] lists indices into `params`.
std::string format_plan(const std::vector<PlanParam>& params, const std::vector<std::vector<size_t>>& buckets);

// The buckets a plan's text gives for `params`. kInvalidArgument naming
// `argument` and the first difference: a malformed line, an unknown or
// repeated name, a parameter the plan leaves out, a dtype that is not the
// parameter's.
std::vector<std::vector<size_t>> parse_plan(const std::string& text, const std::vector<PlanParam>& params,
                                            const char* argument);

}  // namespace dparallel::ddp
