// dp_fsdp_mark_grad_ready: FSDP2's per-parameter post-accumulate hook. The
// host's autograd marks each managed parameter whose full gradient is final,
// from any thread; the mark that completes the set runs post_backward on its
// own thread (it only queues the reduce-scatter on the lane, as the host's
// explicit call does), and finish_backward waits for it as usual.
#include <iterator>
#include <string>
#include <utility>

#include "core/error.h"
#include "fsdp/fully_shard.h"

namespace dparallel::fsdp {

void FullyShard::clear_marks_locked() {
  marked_.assign(layout_.size(), false);
  num_marked_ = 0;
}

std::string FullyShard::unmarked_locked() const {
  if (num_marked_ == 0) return "";
  std::string names;
  for (size_t i = 0; i < layout_.size(); ++i) {
    if (!layout_.at(i).reduced || (i < marked_.size() && marked_[i])) continue;
    names += str_cat(names.empty() ? "" : ", ", "'", layout_.at(i).name, "'");
  }
  return names;
}

void FullyShard::mark_grad_ready(const std::string& name, std::vector<Event> host_ready) {
  // Marks from several threads are serialised with each other and with the
  // host's other calls: the last one runs post_backward under the same locks.
  std::lock_guard<std::mutex> host(host_mutex_);
  std::unique_lock<std::mutex> lock(mutex_);
  check_usable_locked();
  size_t index = npos;
  for (size_t i = 0; i < layout_.size(); ++i) {
    if (layout_.at(i).name == name) {
      index = i;
      break;
    }
  }
  if (index == npos) {
    fail_invalid("argument 'name': dp_fsdp #", lane_id_, " manages no parameter '", name,
                 "' (names are relative to the module it was created over; dp_fsdp_parameter_name lists them)");
  }
  if (!layout_.at(index).reduced) {
    fail_invalid("argument 'name': parameter '", name, "' of dp_fsdp #", lane_id_,
                 " did not require grad when the dp_fsdp was created, so its gradient is never reduced and takes no "
                 "mark");
  }
  if (posted_by_marks_) {
    fail(StatusCode::kState, "parameter '", name, "' of dp_fsdp #", lane_id_,
         " was already marked in this backward: every parameter was marked and its post_backward ran");
  }
  if (marked_.size() != layout_.size()) clear_marks_locked();
  if (marked_[index]) {
    fail(StatusCode::kState, "parameter '", name, "' of dp_fsdp #", lane_id_,
         " was already marked ready in this backward");
  }
  if (!unsharded_since_post_) {
    fail(StatusCode::kState, "parameter '", name, "' of dp_fsdp #", lane_id_,
         " was marked, but the dp_fsdp was not unsharded since its last post_backward, so no full gradient can have "
         "been computed: call dp_fsdp_unshard before the module's forward and backward");
  }
  marked_[index] = true;
  ++num_marked_;
  marks_ready_.insert(marks_ready_.end(), std::make_move_iterator(host_ready.begin()),
                      std::make_move_iterator(host_ready.end()));
  size_t wanted = 0;
  for (const ShardedParam& m : layout_.params()) wanted += m.reduced ? 1 : 0;
  if (num_marked_ < wanted) return;
  // The set is complete: this backward's post_backward, here. An explicit
  // one the host makes later for the same backward is a no-op.
  posted_by_marks_ = true;
  post_backward_locked(lock, {});
}

void FullyShard::finish_marked_backward_locked(std::unique_lock<std::mutex>& lock) {
  const std::string unmarked = unmarked_locked();
  if (unmarked.empty()) return;
  const bool several = unmarked.find(',') != std::string::npos;
  const std::string why =
      str_cat("dp_fsdp #", lane_id_, ": parameter", several ? "s " : " ", unmarked, several ? " were" : " was",
              " never marked ready (dp_fsdp_mark_grad_ready) in a backward that marked others, so its "
              "post_backward never ran; no gradient of this backward is reduced, on any rank");
  try {
    post_backward_locked(lock, {}, why);
  } catch (const Error& e) {
    // The refusal itself (the verdict names this rank's reason) or a wait
    // that gave up: the mark is what the host must fix.
    if (broken_) throw;
    fail(StatusCode::kState, why);
  }
  fail(StatusCode::kState, why);
}

}  // namespace dparallel::fsdp
