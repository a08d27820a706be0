// ProcessGroup::shrink (process_group.h): the ranks still alive after a
// failure agree through the store on who is left and form a new group.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

#include "core/error.h"
#include "distributed/backend_choice.h"
#include "distributed/process_group.h"

namespace dparallel::dist {

namespace {

using Clock = std::chrono::steady_clock;

// How long past the survey's deadline a rank waits for the decision: the
// decider's set follows its add at once.
constexpr Millis kDecisionWait{10000};

enum class Seen : uint8_t { kUnknown, kAlive, kLost };

Bytes encode_ranks(const std::vector<int32_t>& ranks) {
  Bytes out(ranks.size() * sizeof(int32_t));
  if (!ranks.empty()) std::memcpy(out.data(), ranks.data(), out.size());
  return out;
}

std::string rank_list(const std::vector<int32_t>& ranks) {
  std::string out;
  for (int32_t r : ranks) out += str_cat(out.empty() ? "" : ", ", r);
  return out.empty() ? "none" : out;
}

}  // namespace

std::string departure_key(const std::string& prefix, int32_t rank) { return str_cat(prefix, "gone/", rank); }

std::vector<int32_t> ProcessGroup::lost_ranks() {
  std::lock_guard<std::mutex> lock(mutex_);
  return lost_ranks_;
}

std::unique_ptr<ProcessGroup> ProcessGroup::shrink() {
  const GroupLineage& from = lineage();
  Store& store = *from.store;
  const int32_t world = size();
  const std::string base = str_cat(from.prefix, "shrink", shrinks_++, "/");
  const std::string members_key = base + "members";
  // A survivor that learnt of the failure only at its own call's timeout
  // comes up to a timeout after the others: the survey waits twice that.
  const Millis survey = 2 * timeout();
  const auto deadline = Clock::now() + survey;
  std::vector<Seen> seen(static_cast<size_t>(world), Seen::kUnknown);
  seen[static_cast<size_t>(rank())] = Seen::kAlive;
  Bytes decision;
  try {
    // The survey ends at the deadline; the requests after it still need their time.
    ReplyDeadlineCap cap(survey + kDecisionWait);
    store.set(str_cat(base, "alive/", rank()), {});
    // Every rank alive or lost, or another rank has decided already.
    auto settled = [&] {
      if (store.check({members_key})) return true;
      bool all = true;
      for (int32_t r = 0; r < world; ++r) {
        Seen& s = seen[static_cast<size_t>(r)];
        if (s != Seen::kUnknown) continue;
        if (store.check({str_cat(base, "alive/", r)})) {
          s = Seen::kAlive;
        } else if (store.check({departure_key(from.prefix, r)})) {
          s = Seen::kLost;
        } else {
          all = false;
        }
      }
      return all;
    };
    // A last look: a rank may have come during the last pause.
    if (!poll_until(settled, left_until(deadline))) settled();
    if (!store.check({members_key})) {
      std::vector<int32_t> alive;
      std::string unseen;
      for (int32_t r = 0; r < world; ++r) {
        const Seen s = seen[static_cast<size_t>(r)];
        if (s == Seen::kAlive) alive.push_back(r);
        if (s == Seen::kUnknown) unseen += str_cat(unseen.empty() ? "" : ", ", r);
      }
      const auto lost = static_cast<size_t>(std::count(seen.begin(), seen.end(), Seen::kLost));
      if (world > 1 && alive.size() + lost < 2) {
        // Alone, it cannot tell the others' failure from its own: it
        // withdraws rather than go on as a group of one.
        forget_keys(store, {str_cat(base, "alive/", rank())});
        fail(StatusCode::kTimeout, "shrink on rank ", rank(), " of ", world,
             ": no other rank called shrink or was seen ", "lost within ", survey.count(), " ms (ranks ", unseen,
             "); alone, this rank cannot tell their failure from its own, so it forms no group");
      }
      // The first rank here decides; the others take its decision.
      if (store.add(base + "deciding", 1) == 1) store.set(members_key, encode_ranks(alive));
    }
  } catch (const Error& e) {
    fail(e.code() == StatusCode::kTimeout ? StatusCode::kTimeout : StatusCode::kRemote, "shrink on rank ", rank(),
         " of ", world, ": the store, through which the survivors agree, failed: ", e.what(),
         " (a shrink cannot survive the loss of the store's host)");
  }
  try {
    decision = store.get(members_key, left_until(deadline) + kDecisionWait);
  } catch (const Error& e) {
    fail(e.code() == StatusCode::kTimeout ? StatusCode::kTimeout : StatusCode::kRemote, "shrink on rank ", rank(),
         " of ", world, ": no decision on who is left came (the deciding rank may have failed): ", e.what());
  }
  if (decision.size() % sizeof(int32_t) != 0) {
    fail(StatusCode::kIo, "shrink on rank ", rank(), ": the decision in the store is malformed (", decision.size(),
         " bytes)");
  }
  std::vector<int32_t> members(decision.size() / sizeof(int32_t));
  if (!members.empty()) std::memcpy(members.data(), decision.data(), decision.size());
  std::vector<int32_t> lost;
  for (int32_t r = 0; r < world; ++r) {
    if (std::find(members.begin(), members.end(), r) == members.end()) lost.push_back(r);
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    lost_ranks_ = lost;
  }
  auto mine = std::find(members.begin(), members.end(), rank());
  if (mine == members.end()) {
    fail(StatusCode::kState, "shrink: rank ", rank(), " of ", world,
         " was left out of the new group: the others decided before it called shrink or was seen alive (ranks left: ",
         rank_list(members), ")");
  }
  ProcessGroupOptions child;
  child.backend = from.backend;
  child.timeout = timeout();
  child.device = device();
  child.master_addr = from.master_addr;
  child.network_paced = from.network_paced;
  child.world_size = static_cast<int32_t>(members.size());
  child.rank = static_cast<int32_t>(mine - members.begin());
  child.store = std::make_shared<PrefixStore>(from.store, base + "group/");
  std::unique_ptr<ProcessGroup> group = create_chosen_process_group(child);
  {
    std::lock_guard<std::mutex> lock(group->mutex_);
    group->lost_ranks_ = std::move(lost);
  }
  return group;
}

}  // namespace dparallel::dist
