// What one agreement round of the comm lane sends (comm_lane.h): every
// rank's report on each owner with jobs, all-gathered, and what the ranks
// agree on from them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "distributed/call_header.h"
#include "distributed/process_group.h"
#include "lane/lane_owner.h"

namespace dparallel::lane {

// How many owners' reports one round carries; an owner past them waits for
// a later round.
constexpr size_t kOwnersPerRound = 128;

// The identity a job's calls carry in their call header: (owner, job number).
dist::CallTag job_tag(uint32_t owner_id, uint32_t number, const JobSpec& spec);

// What a rank says of one owner in a round.
struct OwnerReport {
  uint32_t id = 0;
  uint32_t issued = 0;    // jobs issued
  uint32_t executed = 0;  // jobs run: its next job's number
  bool joined = false;    // dp_ddp_join: this rank shadows the others' jobs
  int64_t next_item = 0;  // the next job's CallTag item + 1, 0 when none is pending
  uint32_t next_iteration = 0;
};
// A report on the wire: its fields in OwnerReport's order, `joined` as 0 or 1.
constexpr size_t kReportFields = 6;

// Field `f` of the `owner`th report in one rank's vector.
int64_t report_field(const std::vector<int64_t>& v, size_t owner, size_t f);

// Collective: every rank's owner reports, all-gathered: one int64 vector per
// rank, [count, then kReportFields values per owner].
std::vector<std::vector<int64_t>> exchange_counts(dist::ProcessGroup& group, uint32_t round,
                                                  const std::vector<OwnerReport>& mine);

// For each owner every rank listed: how many of its jobs every rank issued.
// kRemote when a rank's vector is malformed.
std::map<uint32_t, uint32_t> agreed_counts(const std::vector<std::vector<int64_t>>& counts);

// For each owner: how many ranks report it joined.
std::map<uint32_t, int32_t> joined_counts(const std::vector<std::vector<int64_t>>& counts);

}  // namespace dparallel::lane
