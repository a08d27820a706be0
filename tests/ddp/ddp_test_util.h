// What the single-process dp_ddp suites share: a small net and the bucket
// plan's text.
#pragma once

#include <string>

#include "module/module_test_util.h"

namespace dptest {

// fc1, fc2, fc3: Linear(2, 2) each.
inline ModulePtr linear_net() {
  ModulePtr root = new_module();
  const char* layers[] = {"fc1", "fc2", "fc3"};
  for (int l = 0; l < 3; ++l) {
    ModulePtr fc = linear(2, 2, static_cast<float>(l));
    EXPECT_EQ(dp_module_register_module(root.get(), layers[l], fc.get()), DP_OK) << dp_last_error();
  }
  return root;
}

// dp_ddp_bucket_plan's text.
inline std::string plan_text(const dp_ddp* ddp) {
  size_t len = 0;
  EXPECT_EQ(dp_ddp_bucket_plan(ddp, nullptr, 0, &len), DP_OK) << dp_last_error();
  std::string text(len + 1, '\0');
  EXPECT_EQ(dp_ddp_bucket_plan(ddp, text.data(), text.size(), &len), DP_OK) << dp_last_error();
  text.resize(len);
  return text;
}

}  // namespace dptest
