// The steps of a sharded save that the synchronous save (fsdp_state_dict.cpp)
// and the background one (async_save.cpp) share, so that both write the same
// files and manifest.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "distributed/process_group.h"
#include "fsdp/state_dict_entries.h"
#include "module/state_dict.h"

namespace dparallel::fsdp {

// How a rank's part of a collective save or load went, as the ranks tell
// each other: "ok[ detail]" or "error <code> <message>".
struct Outcome {
  StatusCode code = StatusCode::kOk;
  std::string message;
  bool ok() const { return code == StatusCode::kOk; }
};

std::string encode_outcome(const Outcome& o, const std::string& detail = "");
Outcome decode_outcome(const std::string& text, int32_t rank, std::string* detail = nullptr);
// This rank's failure, else the lowest failing rank's, named; nothing when every rank's step went well.
void fail_on_every_rank(const std::vector<std::string>& outcomes, const Outcome& mine, int32_t rank,
                        const std::string& what);

// A state dict's checks: every dp_fsdp holding the module's tensors is on
// `group` and replicates across one group (or none); kInvalidArgument naming
// the parameter. Returns the dp_fsdp whose lane carries the state dict's
// collectives (null when none holds the module's tensors).
std::shared_ptr<FullyShard> check_state_groups(const std::vector<Held>& state, const dist::ProcessGroup& group);

// What a rank's file of a sharded save holds: its tensors (the shards as
// held, or copies of them) and where each piece lies in its full tensor.
struct RankPiece {
  std::string name;
  int64_t first_row = -1;  // -1 for a whole tensor
  int64_t row_count = -1;
  int64_t rows = -1;  // the full tensor's rows when sharded
};
struct RankFile {
  std::vector<StateEntry> entries;
  std::vector<RankPiece> pieces;  // one per entry
};
RankFile rank_file_of(const std::vector<Held>& state, int32_t rank);

void make_folder(const std::string& folder);
void remove_quietly(const std::string& path);
// Writes rank `rank`'s file at `path` and returns its report: what the
// manifest needs of it (JSON text).
std::string write_rank_file(const RankFile& file, int32_t rank, int32_t world, const std::string& save_id,
                            const std::string& path);
// Rank 0, once every rank reported its file written ("ok <report>" each,
// in rank order): the manifest, last and atomically.
void write_manifest(const std::string& folder, const std::string& save_id, int32_t world,
                    const std::vector<std::string>& reports);
// Rank 0, once a save is complete: the rank files of every other save in the folder.
void remove_other_saves(const std::string& folder, const std::string& save_id);

}  // namespace dparallel::fsdp
