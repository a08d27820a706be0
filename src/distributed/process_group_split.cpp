// ProcessGroup's hosts and splits (process_group.h): what a group learnt at
// its creation, and new groups of some of its ranks over its store.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <utility>
#include <vector>

#include "core/error.h"
#include "distributed/backend_choice.h"
#include "distributed/process_group.h"

namespace dparallel::dist {

namespace {

const Device kHost{DeviceType::kCpu, 0};

// What each rank sends in a split's exchange; kOwnConnections: 1 where this
// rank's part can come from the group's own connections (Backend::splits_into).
enum SplitField : size_t { kColor, kKey, kNumber, kAgreement, kOwnConnections, kSplitFields };

}  // namespace

void ProcessGroup::set_lineage(GroupLineage lineage) {
  // The keys' prefix is the same on every rank: what a diagnosis matches.
  recorder_->set_group_id(lineage.prefix);
  lineage_ = std::make_shared<const GroupLineage>(std::move(lineage));
  // What a shrink reads to know this rank lost at once; a store that cannot
  // say leaves it to the shrink's timeout.
  try {
    lineage_->store->set_on_close(departure_key(lineage_->prefix, rank()), {});
  } catch (const Error&) {
  }
}

const GroupLineage& ProcessGroup::lineage() const {
  if (!lineage_) {
    fail(StatusCode::kState, "this ", backend_->name(),
         " group was made inside another group, not by create_process_group: it has no hosts or store of its own");
  }
  return *lineage_;
}

int32_t ProcessGroup::local_rank() const {
  const std::vector<int32_t>& hosts = lineage().host_of_rank;
  const int32_t mine = hosts[static_cast<size_t>(rank())];
  return static_cast<int32_t>(std::count(hosts.begin(), hosts.begin() + rank(), mine));
}

int32_t ProcessGroup::local_size() const {
  const std::vector<int32_t>& hosts = lineage().host_of_rank;
  return static_cast<int32_t>(std::count(hosts.begin(), hosts.end(), hosts[static_cast<size_t>(rank())]));
}

int32_t ProcessGroup::num_hosts() const {
  const std::vector<int32_t>& hosts = lineage().host_of_rank;
  return hosts.empty() ? 0 : *std::max_element(hosts.begin(), hosts.end()) + 1;
}

std::unique_ptr<ProcessGroup> ProcessGroup::split(int32_t color, int32_t key, const SplitOptions& options,
                                                  uint64_t agreement, const char* what) {
  const GroupLineage& from = lineage();
  ProcessGroupOptions child;
  child.backend = options.backend;
  child.timeout = options.timeout;
  child.device = options.device;
  child.master_addr = from.master_addr;
  check_arguments(CallKind::kAllGather, false, [&] {
    // The new group's rank and size are known only after the exchange.
    ProcessGroupOptions probe = child;
    probe.rank = 0;
    probe.world_size = 1;
    check_process_group_options(probe);
  });
  const Device device = this->device();
  Tensor mine = Tensor::empty(DType::kInt64, {kSplitFields}, kHost);
  auto* values = static_cast<int64_t*>(mine.data());
  values[kColor] = color;
  values[kKey] = key;
  values[kNumber] = static_cast<int64_t>(splits_);
  std::memcpy(&values[kAgreement], &agreement, sizeof(agreement));
  // A rank of no color joins no new group, but takes part in the split of
  // the connections all the same: it must be able to.
  const BackendEntry* own = find_backend_named(backend_->name());
  values[kOwnConnections] =
      color < 0 ? own != nullptr && backend_->splits_into(own->choice, device)
                : backend_->splits_into(device_backend_choice(options.backend, options.device), options.device);
  std::vector<Tensor> all;
  all.reserve(static_cast<size_t>(size()));
  for (int32_t r = 0; r < size(); ++r) all.push_back(Tensor::empty(DType::kInt64, {kSplitFields}, device));
  all_gather(device == kHost ? mine : mine.to(device), all, false);
  std::vector<std::vector<int64_t>> by_rank;
  by_rank.reserve(all.size());
  for (const Tensor& t : all) {
    Tensor host = t.device() == kHost ? t : t.to(kHost);
    const auto* v = static_cast<const int64_t*>(host.data());
    by_rank.emplace_back(v, v + kSplitFields);
  }
  // Every rank checks the same values, so all fail alike or go on alike.
  const uint64_t number = splits_++;
  std::string differing;
  for (size_t r = 0; r < by_rank.size(); ++r) {
    if (by_rank[r][kNumber] != static_cast<int64_t>(number)) {
      fail(StatusCode::kState, "split: rank ", r, " is at its split ", by_rank[r][kNumber], " of this group, rank ",
           rank(), " at ", number, "; the group's calls are out of step");
    }
    if (by_rank[r][kAgreement] != by_rank[0][kAgreement]) differing += str_cat(differing.empty() ? "" : ", ", r);
  }
  if (!differing.empty()) {
    fail_invalid("split: rank(s) ", differing, " passed a different ", what,
                 " from rank 0's; every rank must pass the same");
  }
  // The parent's connections make the new groups only where every rank's
  // can: each rank takes part in that split, those of no color too.
  bool own_connections = true;
  for (const std::vector<int64_t>& v : by_rank) own_connections = own_connections && v[kOwnConnections] == 1;
  if (color < 0) {
    if (own_connections) backend_->split_without_color(std::chrono::steady_clock::now() + timeout());
    return nullptr;
  }
  if (own_connections) child.split = BackendSplit{backend_.get(), color, key};
  std::vector<std::pair<int64_t, int32_t>> members;  // (key, rank here), of this color
  for (size_t r = 0; r < by_rank.size(); ++r) {
    if (by_rank[r][kColor] == color) members.emplace_back(by_rank[r][kKey], static_cast<int32_t>(r));
  }
  std::sort(members.begin(), members.end());
  child.world_size = static_cast<int32_t>(members.size());
  child.rank = static_cast<int32_t>(std::find(members.begin(), members.end(), std::make_pair(int64_t{key}, rank())) -
                                    members.begin());
  child.store = std::make_shared<PrefixStore>(from.store, str_cat(from.prefix, "split", number, "/", color, "/"));
  return create_chosen_process_group(child);
}

}  // namespace dparallel::dist
