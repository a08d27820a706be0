#include "fsdp/fsdp_state_dict.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <new>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "fsdp/fully_shard.h"
#include "fsdp/save_manifest.h"
#include "fsdp/sharded_load_plan.h"
#include "fsdp/sharded_save_steps.h"
#include "fsdp/state_dict_entries.h"
#include "lane/agreement.h"
#include "module/safetensors.h"
#include "module/state_dict.h"

namespace dparallel::fsdp {

std::vector<Held> held_state(Module& module) {
  std::map<TensorIdentity, std::shared_ptr<Parameter>> by_value;
  for (const NamedParameter& np : module.named_parameters())
    by_value[identity_of(np.parameter->value())] = np.parameter;
  std::vector<Held> out;
  for (StateEntry& e : state_dict(module)) {
    Held h;
    auto it = by_value.find(identity_of(e.value));
    if (it != by_value.end()) {
      h.holder = std::dynamic_pointer_cast<FullyShard>(it->second->sharding());
      if (h.holder) h.index = h.holder->index_of(it->second.get());
    }
    h.entry = std::move(e);
    out.push_back(std::move(h));
  }
  return out;
}

void check_resharded(const FullyShard& holder, const std::string& name) {
  if (!holder.resharded()) {
    fail(StatusCode::kState, "parameter '", name,
         "' is unsharded or being unsharded (its slot holds, or is to hold, the full parameter): reshard its "
         "dp_fsdp first");
  }
}

namespace {

using Json = nlohmann::json;

void check_group(const Held& h, const dist::ProcessGroup& group) {
  if (h.holder && h.holder->group().get() != &group) {
    fail_invalid("parameter '", h.entry.name, "' is held by a dp_fsdp on another process group than argument 'pg'");
  }
}

// Every dp_fsdp holding the module's tensors replicates across one group
// (or none): a state dict's collectives agree over it.
void check_replicas(const std::vector<Held>& state) {
  const Held* first = nullptr;
  for (const Held& h : state) {
    if (!h.holder) continue;
    if (first == nullptr) first = &h;
    if (h.holder->replicate_group() != first->holder->replicate_group()) {
      fail_invalid("parameters '", first->entry.name, "' and '", h.entry.name,
                   "' are held by dp_fsdp with different replicate groups: a state dict agrees over one");
    }
  }
}

// The dp_fsdp whose lane carries a state dict's collectives, so that they
// pair with its other jobs; null when no dp_fsdp holds the module's tensors.
std::shared_ptr<FullyShard> lane_holder(const std::vector<Held>& state) {
  for (const Held& h : state) {
    if (h.holder) return h.holder;
  }
  return nullptr;
}

// Every rank's `mine`, on the holder's lane or as the host's own call.
std::vector<std::string> exchange(dist::ProcessGroup& group, const std::shared_ptr<FullyShard>& holder,
                                  const std::string& mine) {
  std::vector<std::string> all;
  if (holder) {
    holder->call_on_lane(dist::CallItem::kStateDict, [&] { all = lane::all_gather_strings(group, mine); });
  } else {
    all = lane::all_gather_strings(group, mine);
  }
  return all;
}

template <typename Step>
Outcome run_step(Step&& step) {
  try {
    step();
    return {};
  } catch (const Error& e) {
    return {e.code(), e.what()};
  } catch (const std::bad_alloc&) {
    return {StatusCode::kOutOfMemory, "out of memory"};
  } catch (const std::exception& e) {
    return {StatusCode::kInternal, e.what()};
  }
}

// HSDP: every replica learns every replica's `mine` (its shard group's
// verdict); fails with this rank's, else the lowest failing replica's, so
// that every rank of both groups ends alike. Without replicas: `mine`.
void agree_across_replicas(const std::shared_ptr<FullyShard>& holder, const Outcome& mine, const std::string& what) {
  const std::shared_ptr<dist::ProcessGroup> replicas = holder ? holder->replicate_group() : nullptr;
  if (replicas) {
    std::vector<std::string> all;
    holder->call_on_replicate_lane(dist::CallItem::kStateDict,
                                   [&] { all = lane::all_gather_strings(*replicas, encode_outcome(mine)); });
    if (!mine.ok()) fail(mine.code, mine.message);
    for (size_t r = 0; r < all.size(); ++r) {
      const Outcome o = decode_outcome(all[r], static_cast<int32_t>(r));
      if (!o.ok()) fail(o.code, what, " failed on rank ", r, " of the replicate group: ", o.message);
    }
  }
  if (!mine.ok()) fail(mine.code, mine.message);
}

}  // namespace

std::string encode_outcome(const Outcome& o, const std::string& detail) {
  if (o.ok()) return detail.empty() ? "ok" : "ok " + detail;
  return str_cat("error ", static_cast<int>(o.code), " ", o.message);
}

Outcome decode_outcome(const std::string& text, int32_t rank, std::string* detail) {
  if (text == "ok" || text.rfind("ok ", 0) == 0) {
    if (detail) *detail = text.size() > 3 ? text.substr(3) : std::string();
    return {};
  }
  int code = 0, used = 0;
  if (std::sscanf(text.c_str(), "error %d %n", &code, &used) == 1 && code < 0 &&
      code >= static_cast<int>(StatusCode::kInternal)) {
    return {static_cast<StatusCode>(code), text.substr(static_cast<size_t>(used))};
  }
  return {StatusCode::kRemote, str_cat("rank ", rank, " sent a malformed outcome")};
}

// This rank's failure, else the lowest failing rank's, named; nothing when every rank's step went well.
void fail_on_every_rank(const std::vector<std::string>& outcomes, const Outcome& mine, int32_t rank,
                        const std::string& what) {
  if (!mine.ok()) fail(mine.code, mine.message);
  for (size_t r = 0; r < outcomes.size(); ++r) {
    const Outcome o = decode_outcome(outcomes[r], static_cast<int32_t>(r));
    if (!o.ok() && static_cast<int32_t>(r) != rank) fail(o.code, what, " failed on rank ", r, ": ", o.message);
  }
}

// ---- sharded saves ----

void remove_quietly(const std::string& path) { (void)::unlink(path.c_str()); }

void make_folder(const std::string& folder) {
  if (::mkdir(folder.c_str(), 0777) != 0 && errno != EEXIST) {
    fail(StatusCode::kIo, "cannot make the folder '", folder, "': ", std::strerror(errno));
  }
  struct stat info {};
  if (::stat(folder.c_str(), &info) != 0 || !S_ISDIR(info.st_mode)) {
    fail_invalid("argument 'folder' ('", folder, "') is not a folder");
  }
}

RankFile rank_file_of(const std::vector<Held>& state, int32_t rank) {
  RankFile file;
  for (const Held& h : state) {
    if (!h.sharded()) {
      // Whole tensors are rank 0's to write.
      if (rank != 0) continue;
      file.entries.push_back(StateEntry{h.entry.name, h.holder ? h.holder->shard(h.index) : h.entry.value});
      file.pieces.push_back(RankPiece{h.entry.name});
      continue;
    }
    const RowSplit split = h.holder->split_of(h.index, rank);
    file.entries.push_back(StateEntry{h.entry.name, h.holder->shard(h.index)});
    file.pieces.push_back(RankPiece{h.entry.name, split.start, split.count, h.holder->full_shape(h.index).front()});
  }
  return file;
}

std::string write_rank_file(const RankFile& file, int32_t rank, int32_t world, const std::string& save_id,
                            const std::string& path) {
  std::map<std::string, std::string> metadata{{"format", kShardedFormat},
                                              {"rank", std::to_string(rank)},
                                              {"world", std::to_string(world)},
                                              {kSaveIdKey, save_id}};
  Json pieces = Json::array();
  for (const RankPiece& p : file.pieces) {
    if (p.rows < 0) {
      pieces.push_back({{"name", p.name}});
      continue;
    }
    metadata[kRowsKey + p.name] = str_cat(p.first_row, " ", p.row_count, " ", p.rows);
    pieces.push_back({{"name", p.name}, {"first_row", p.first_row}, {"row_count", p.row_count}, {"rows", p.rows}});
  }
  const SavedFile saved = save_state(file.entries, metadata, path);
  for (size_t i = 0; i < file.entries.size(); ++i) pieces[i]["crc32c"] = saved.entry_crcs.at(i);
  return Json{{"bytes", saved.bytes}, {"header_crc32c", saved.header_crc}, {"pieces", std::move(pieces)}}.dump();
}

void write_manifest(const std::string& folder, const std::string& save_id, int32_t world,
                    const std::vector<std::string>& reports) {
  Manifest m;
  m.save_id = save_id;
  m.world_size = world;
  std::map<std::string, size_t> tensor_index;
  for (int32_t r = 0; r < world; ++r) {
    std::string detail;
    decode_outcome(reports.at(static_cast<size_t>(r)), r, &detail);
    try {
      const Json report = Json::parse(detail);
      m.files.push_back(ManifestFile{shard_file_name(r, world, save_id), report.at("bytes").get<uint64_t>(),
                                     report.at("header_crc32c").get<uint32_t>()});
      for (const Json& p : report.at("pieces")) {
        const std::string name = p.at("name").get<std::string>();
        auto [it, added] = tensor_index.try_emplace(name, m.tensors.size());
        if (added) m.tensors.push_back(ManifestTensor{name, p.contains("rows") ? p.at("rows").get<int64_t>() : -1, {}});
        ManifestPiece piece;
        piece.file = static_cast<size_t>(r);
        piece.crc = p.at("crc32c").get<uint32_t>();
        if (p.contains("rows")) {
          piece.first_row = p.at("first_row").get<int64_t>();
          piece.row_count = p.at("row_count").get<int64_t>();
        }
        m.tensors[it->second].pieces.push_back(piece);
      }
    } catch (const Json::exception& e) {
      fail(StatusCode::kRemote, "rank ", r, " sent a malformed report of its file: ", e.what());
    }
  }
  const std::string path = folder + "/" + kManifestName;
  const std::string text = encode_manifest(m);
  // Never a manifest that a load would refuse (ranks that disagree on a tensor's rows).
  parse_manifest(text, path);
  write_atomically(path, [&](std::FILE* f) { return std::fwrite(text.data(), 1, text.size(), f) == text.size(); });
}

void remove_other_saves(const std::string& folder, const std::string& save_id) {
  DIR* dir = ::opendir(folder.c_str());
  if (dir == nullptr) return;
  std::vector<std::string> stale;
  while (dirent* d = ::readdir(dir)) {
    std::string id;
    if (parse_shard_file_name(d->d_name, &id) && id != save_id) stale.push_back(folder + "/" + d->d_name);
  }
  ::closedir(dir);
  for (const std::string& path : stale) remove_quietly(path);
}

std::shared_ptr<FullyShard> check_state_groups(const std::vector<Held>& state, const dist::ProcessGroup& group) {
  for (const Held& h : state) check_group(h, group);
  check_replicas(state);
  return lane_holder(state);
}

void save_full_state_dict(Module& module, dist::ProcessGroup& group, const std::string& path) {
  std::vector<Held> state = held_state(module);
  for (const Held& h : state) check_group(h, group);
  check_replicas(state);
  const std::shared_ptr<FullyShard> holder = lane_holder(state);
  // Rank 0 of the shard group writes, and with replicas only that of the
  // replicate group's rank 0: rank 0 of the world.
  const bool writes = group.rank() == 0 && (!holder || holder->writes_shards());
  const std::string kept = str_cat(" (a file that was at '", path, "' is as it was)");
  const Outcome verdict = run_step([&] {
    // One gather per dp_fsdp, in the order its first parameter is listed: the same on every rank.
    std::vector<std::shared_ptr<FullyShard>> holders;
    for (const Held& h : state) {
      if (h.holder && std::find(holders.begin(), holders.end(), h.holder) == holders.end()) holders.push_back(h.holder);
    }
    std::map<const FullyShard*, std::vector<Tensor>> full;
    for (const auto& h : holders) full[h.get()] = h->gather_full_values();
    Outcome wrote;
    if (writes) {
      wrote = run_step([&] {
        std::vector<StateEntry> entries;
        entries.reserve(state.size());
        for (const Held& h : state) {
          entries.push_back(h.holder ? StateEntry{h.entry.name, full[h.holder.get()].at(h.index)} : h.entry);
        }
        save_state(entries, {{"format", "pt"}}, path);
      });
    }
    full.clear();
    // Rank 0's write is every rank's outcome.
    const std::vector<std::string> outcomes = exchange(group, holder, encode_outcome(wrote));
    const Outcome rank0 = decode_outcome(outcomes.at(0), 0);
    if (!rank0.ok()) {
      fail(rank0.code, writes ? std::string() : "rank 0 could not write the full state dict: ", rank0.message, kept);
    }
  });
  agree_across_replicas(holder, verdict, str_cat("the full state dict's save to '", path, "'"));
}

void refuse_full_state_dict_save(Module& module, dist::ProcessGroup& group, const std::string& reason) {
  const std::vector<Held> state = held_state(module);
  const std::shared_ptr<FullyShard> holder = lane_holder(state);
  const Outcome refused = run_step([&] {
    // The gathers in save_full_state_dict's order (one with no collective
    // is skipped there too), else the outcomes' exchange.
    std::vector<const FullyShard*> seen;
    for (const Held& h : state) {
      if (!h.holder || std::find(seen.begin(), seen.end(), h.holder.get()) != seen.end()) continue;
      seen.push_back(h.holder.get());
      h.holder->refuse_gather(reason);
    }
    if (holder) {
      holder->call_on_lane(dist::CallItem::kStateDict,
                           [&] { group.refuse(dist::CallKind::kAllGather, reason, false); });
    } else {
      group.refuse(dist::CallKind::kAllGather, reason, false);
    }
  });
  // With replicas, they take part as in a save (in agree_across_replicas).
  agree_across_replicas(holder, refused.ok() ? Outcome{StatusCode::kInvalidArgument, reason} : refused,
                        "the full state dict's save");
  fail_invalid(reason);
}

namespace {

// The child of `parent` named `name`, made when missing.
Module& child_named(Module& parent, const std::string& name) {
  for (const Module::ChildSlot& c : parent.child_slots()) {
    if (c.name == name && c.module) return *c.module;
  }
  auto child = std::make_shared<Module>();
  parent.register_module(name, child);
  return *child;
}

// A module tree holding `value` under each dotted name, as `module` lists them.
std::shared_ptr<Module> state_module(Module& module, const std::vector<Held>& state,
                                     std::map<const FullyShard*, std::vector<Tensor>>& full) {
  const Device cpu{DeviceType::kCpu, 0};
  auto out = std::make_shared<Module>();
  for (const Held& h : state) {
    const Tensor& source = h.holder ? full[h.holder.get()].at(h.index) : h.entry.value;
    // A gathered value is already a tensor of its own: kept, not copied, on cpu.
    const bool on_cpu = source.device().is_cpu();
    Tensor value = h.holder && on_cpu ? source : source.to(on_cpu ? source.device() : cpu);
    Module* owner = out.get();
    std::string leaf = h.entry.name;
    for (size_t dot = leaf.find('.'); dot != std::string::npos; dot = leaf.find('.')) {
      owner = &child_named(*owner, leaf.substr(0, dot));
      leaf = leaf.substr(dot + 1);
    }
    const NamedTensorSlot slot = module.find_tensor(h.entry.name);
    if (slot.parameter) {
      owner->register_parameter(leaf, value, slot.parameter->requires_grad());
    } else {
      owner->register_buffer(leaf, value, true);
    }
  }
  return out;
}

}  // namespace

std::shared_ptr<Module> full_state_dict(Module& module, dist::ProcessGroup& group, int32_t root) {
  std::vector<Held> state = held_state(module);
  for (const Held& h : state) check_group(h, group);
  // The gathers as in save_full_state_dict (refuse_full_state_dict_save
  // pairs with them), then every rank's outcome in the write's place.
  std::vector<std::shared_ptr<FullyShard>> holders;
  for (const Held& h : state) {
    if (h.holder && std::find(holders.begin(), holders.end(), h.holder) == holders.end()) holders.push_back(h.holder);
  }
  std::map<const FullyShard*, std::vector<Tensor>> full;
  for (const auto& holder : holders) full[holder.get()] = holder->gather_full_values();
  std::shared_ptr<Module> out;
  Outcome built;
  if (root < 0 || group.rank() == root) built = run_step([&] { out = state_module(module, state, full); });
  full.clear();
  const std::vector<std::string> outcomes = exchange(group, lane_holder(state), encode_outcome(built));
  fail_on_every_rank(outcomes, built, group.rank(), "the in-memory full state dict");
  return out;
}

void load_full_state_dict(Module& module, const std::string& path, bool strict) {
  struct Swapped {
    std::shared_ptr<FullyShard> holder;
    size_t index;
    std::shared_ptr<Parameter> parameter;
    Tensor full;
  };
  std::vector<Swapped> swapped;
  for (const NamedParameter& np : module.named_parameters()) {
    auto holder = std::dynamic_pointer_cast<FullyShard>(np.parameter->sharding());
    if (!holder) continue;
    check_resharded(*holder, *np.name);
    const size_t index = holder->index_of(np.parameter.get());
    swapped.push_back(
        Swapped{holder, index, np.parameter,
                Tensor::zeros(holder->dtype(index), holder->full_shape(index), holder->group()->device())});
  }
  // The file loads into full-size stand-ins; each rank then keeps its rows
  // of those the file wrote (a key it lacks leaves the shard alone).
  for (const Swapped& s : swapped) s.parameter->set_value(s.full);
  std::set<TensorIdentity> written;
  try {
    for (const Tensor& t : load_module(module, path, strict)) written.insert(identity_of(t));
  } catch (...) {
    for (const Swapped& s : swapped) s.parameter->set_value(s.holder->shard(s.index));
    throw;
  }
  for (const Swapped& s : swapped) {
    if (written.count(identity_of(s.full)) != 0) s.holder->load_shard_from_full(s.index, s.full);
    s.parameter->set_value(s.holder->shard(s.index));
  }
}

namespace {

// The sharded save over `group`, by the ranks that write it.
void save_sharded_in_group(const std::vector<Held>& state, dist::ProcessGroup& group,
                           const std::shared_ptr<FullyShard>& holder, const std::string& folder,
                           const std::string& refusal, const std::string& what) {
  const int32_t rank = group.rank(), world = group.size();
  const std::string kept = "; nothing of it is kept, and the folder's last complete save is as it was";
  // Rank 0's id names the save.
  const std::string save_id = exchange(group, holder, rank == 0 ? new_save_id() : std::string()).at(0);
  if (!is_save_id(save_id)) fail(StatusCode::kRemote, what, ": rank 0 sent a malformed save id");
  const std::string file = folder + "/" + shard_file_name(rank, world, save_id);
  // Every rank writes its file under a name of this save's: the last save's files stay.
  std::string report;
  const Outcome wrote = run_step([&] {
    if (!refusal.empty()) fail_invalid(refusal);
    make_folder(folder);
    report = write_rank_file(rank_file_of(state, rank), rank, world, save_id, file);
  });
  std::vector<std::string> reports;
  try {
    reports = exchange(group, holder, encode_outcome(wrote, report));
    fail_on_every_rank(reports, wrote, rank, what);
  } catch (const Error& e) {
    if (refusal.empty()) remove_quietly(file);
    fail(e.code(), e.what(), kept);
  }
  // Rank 0 writes the manifest last: the save is complete once it is in place.
  Outcome committed;
  if (rank == 0) committed = run_step([&] { write_manifest(folder, save_id, world, reports); });
  std::vector<std::string> verdict;
  try {
    verdict = exchange(group, holder, encode_outcome(committed));
  } catch (const Error& e) {
    // Whether the manifest is in place may be unknown here: the files stay, and a load checks them.
    fail(e.code(), what,
         committed.ok() && rank == 0 ? " is complete, but the ranks could not learn it: "
                                     : ": the ranks could not learn whether it completed: ",
         e.what());
  }
  const Outcome rank0 = decode_outcome(verdict.at(0), 0);
  if (!rank0.ok()) {
    remove_quietly(file);
    fail(rank0.code, what, " failed on rank 0, writing its manifest: ", rank0.message, kept);
  }
  if (rank == 0) remove_other_saves(folder, save_id);
}

}  // namespace

void save_sharded_state_dict(Module& module, dist::ProcessGroup& group, const std::string& folder,
                             const std::string& refusal) {
  std::vector<Held> state = held_state(module);
  for (const Held& h : state) check_group(h, group);
  check_replicas(state);
  const std::shared_ptr<FullyShard> holder = lane_holder(state);
  const std::string what = str_cat("the sharded save to '", folder, "'");
  if (!holder || !holder->replicate_group()) {
    save_sharded_in_group(state, group, holder, folder, refusal, what);
    return;
  }
  // HSDP: the replicas hold the same shards, so the shard group of the
  // replicate group's rank 0 alone writes them. A refusal on any replica
  // fails its writer's save first (so nothing is committed), then every
  // replica learns its writer's verdict.
  dist::ProcessGroup& replicas = *holder->replicate_group();
  std::vector<std::string> refusals;
  holder->call_on_replicate_lane(dist::CallItem::kStateDict, [&] {
    refusals = lane::all_gather_strings(replicas, refusal.empty() ? std::string("ok") : "error " + refusal);
  });
  std::string writer_refusal = refusal;
  for (size_t r = 0; r < refusals.size() && writer_refusal.empty(); ++r) {
    if (refusals[r] != "ok")
      writer_refusal = str_cat("rank ", r, " of the replicate group refused: ", refusals[r].substr(6));
  }
  Outcome verdict;
  if (holder->writes_shards()) {
    verdict = run_step([&] { save_sharded_in_group(state, group, holder, folder, writer_refusal, what); });
  } else if (!refusal.empty()) {
    verdict = Outcome{StatusCode::kInvalidArgument, refusal};
  }
  agree_across_replicas(holder, verdict, what);
}

void load_sharded_state_dict(Module& module, const std::string& folder, const std::string& refusal) {
  const std::vector<Held> state = held_state(module);
  const std::shared_ptr<FullyShard> holder = lane_holder(state);
  check_replicas(state);
  for (const Held& h : state) {
    if (h.holder && h.holder->group() != holder->group()) {
      fail_invalid("the module's tensors are held by dp_fsdp on two process groups ('", h.entry.name,
                   "' and another): a sharded load agrees over one");
    }
  }
  ShardedLoad plan;
  const Outcome planned = run_step([&] {
    if (!refusal.empty()) fail_invalid(refusal);
    plan = plan_sharded_load(state, folder);
  });
  if (holder) {
    // Every rank loads, or none does (with replicas, every replica too).
    dist::ProcessGroup& group = *holder->group();
    const std::string what = str_cat("the sharded load from '", folder, "' (the module is unchanged on every rank)");
    const Outcome agreed = run_step(
        [&] { fail_on_every_rank(exchange(group, holder, encode_outcome(planned)), planned, group.rank(), what); });
    agree_across_replicas(holder, agreed, what);
  } else if (!planned.ok()) {
    fail(planned.code, planned.message);
  }
  // A read that fails now (a file changed meanwhile) is kIo and may leave
  // the module partly loaded, as dp_module_load.
  std::vector<uint8_t> staging;
  for (const Copy& c : plan.copies)
    plan.files[c.file]->read_into(c.target, c.target_offset, c.offset, c.bytes, staging);
}

}  // namespace dparallel::fsdp
