#include "lane/round_wire.h"

#include <algorithm>
#include <optional>

#include "core/error.h"
#include "core/stream.h"
#include "lane/host_values.h"

namespace dparallel::lane {

dist::CallTag job_tag(uint32_t owner_id, uint32_t number, const JobSpec& spec) {
  dist::CallTag tag;
  tag.owner = owner_id + 1;
  tag.job = number;
  tag.iteration = spec.iteration;
  tag.item = static_cast<uint32_t>(spec.item) << 24 | static_cast<uint32_t>(spec.index & 0xffffffu);
  return tag;
}

int64_t report_field(const std::vector<int64_t>& v, size_t owner, size_t f) { return v[1 + kReportFields * owner + f]; }
// Every rank's owner reports, all-gathered: one int64 vector per rank,
// [count, then kReportFields values per owner].
std::vector<std::vector<int64_t>> exchange_counts(dist::ProcessGroup& group, uint32_t round,
                                                  const std::vector<OwnerReport>& mine) {
  std::vector<int64_t> values(1 + kReportFields * kOwnersPerRound, 0);
  values[0] = static_cast<int64_t>(mine.size());
  for (size_t i = 0; i < mine.size(); ++i) {
    int64_t* at = &values[1 + kReportFields * i];
    at[0] = mine[i].id;
    at[1] = mine[i].issued;
    at[2] = mine[i].executed;
    at[3] = mine[i].joined ? 1 : 0;
    at[4] = mine[i].next_item;
    at[5] = mine[i].next_iteration;
  }
  if (group.size() == 1) return {values};
  dist::CallTag tag;
  tag.owner = dist::kLaneRoundOwner;
  tag.job = round;
  dist::CallTagScope scope(tag);
  const Device device = group.device();
  // Where the group has a control stream (NCCL), the round's copies and
  // allocations go there too: the library stream may wait for a host's
  // stream (any call made with a current stream set), and a round must not.
  // Opened before the tensors, so that their frees follow that stream.
  std::optional<LibraryWorkStaysQueued> staging;
  if (void* control = group.control_stream()) staging.emplace(device, control);
  std::vector<Tensor> all = gather_outputs(group.size(), DType::kInt64, static_cast<int64_t>(values.size()), device);
  group.all_gather(to_device(host_int64(values), device), all, false);
  std::vector<std::vector<int64_t>> counts;
  counts.reserve(all.size());
  for (const Tensor& t : all) counts.push_back(read_int64(t));
  return counts;
}

// For each owner every rank listed: how many of its jobs every rank issued.
std::map<uint32_t, uint32_t> agreed_counts(const std::vector<std::vector<int64_t>>& counts) {
  std::map<uint32_t, uint32_t> agreed;
  for (size_t r = 0; r < counts.size(); ++r) {
    const std::vector<int64_t>& v = counts[r];
    if (v.empty() || v[0] < 0 || v[0] > static_cast<int64_t>(kOwnersPerRound)) {
      fail(StatusCode::kRemote, "rank ", r, " sent a malformed agreement round");
    }
    if (v.size() != 1 + kReportFields * kOwnersPerRound) {
      fail(StatusCode::kRemote, "rank ", r, " sent a malformed agreement round");
    }
    std::map<uint32_t, uint32_t> theirs;
    for (size_t i = 0; i < static_cast<size_t>(v[0]); ++i) {
      int64_t owner = report_field(v, i, 0);
      int64_t issued = report_field(v, i, 1);
      int64_t executed = report_field(v, i, 2);
      int64_t next_item = report_field(v, i, 4);
      if (owner < 0 || owner > UINT32_MAX || issued < 0 || issued > UINT32_MAX || executed < 0 || executed > issued ||
          next_item < 0 || next_item > UINT32_MAX + int64_t{1} || report_field(v, i, 5) < 0 ||
          report_field(v, i, 5) > UINT32_MAX) {
        fail(StatusCode::kRemote, "rank ", r, " sent a malformed agreement round");
      }
      theirs[static_cast<uint32_t>(owner)] = static_cast<uint32_t>(issued);
    }
    if (r == 0) {
      agreed = std::move(theirs);
      continue;
    }
    for (auto it = agreed.begin(); it != agreed.end();) {
      auto found = theirs.find(it->first);
      if (found == theirs.end()) {
        it = agreed.erase(it);
        continue;
      }
      it->second = std::min(it->second, found->second);
      ++it;
    }
  }
  return agreed;
}

// For each owner: how many ranks report it joined.
std::map<uint32_t, int32_t> joined_counts(const std::vector<std::vector<int64_t>>& counts) {
  std::map<uint32_t, int32_t> joined;
  for (const auto& v : counts) {
    for (size_t i = 0; i < static_cast<size_t>(v[0]); ++i) {
      if (report_field(v, i, 3) != 0) ++joined[static_cast<uint32_t>(report_field(v, i, 0))];
    }
  }
  return joined;
}

}  // namespace dparallel::lane
