#include "fsdp/fsdp_state_dict.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <sstream>

#include "core/error.h"
#include "fsdp/fully_shard.h"
#include "module/safetensors.h"
#include "module/state_dict.h"

namespace dparallel::fsdp {

namespace {

constexpr const char* kShardedFormat = "dp-fsdp-sharded";
constexpr const char* kRowsKey = "dp.rows.";

// A state dict entry and, when a dp_fsdp holds it, which one and its index there.
struct Held {
  StateEntry entry;
  std::shared_ptr<FullyShard> holder;
  size_t index = 0;
};

// state_dict(module), each entry with the dp_fsdp that holds it (if any).
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

void check_group(const Held& h, const dist::ProcessGroup& group) {
  if (h.holder && h.holder->group().get() != &group) {
    fail_invalid("parameter '", h.entry.name, "' is held by a dp_fsdp on another process group than argument 'pg'");
  }
}

std::string shard_file(const std::string& folder, int32_t rank, int32_t world) {
  char name[64];
  std::snprintf(name, sizeof name, "/shard-%05d-of-%05d.safetensors", rank, world);
  return folder + name;
}

}  // namespace

void save_full_state_dict(Module& module, dist::ProcessGroup& group, const std::string& path) {
  std::vector<Held> state = held_state(module);
  for (const Held& h : state) check_group(h, group);
  // One gather per dp_fsdp, in the order its first parameter is listed: the same on every rank.
  std::vector<std::shared_ptr<FullyShard>> holders;
  for (const Held& h : state) {
    if (h.holder && std::find(holders.begin(), holders.end(), h.holder) == holders.end()) holders.push_back(h.holder);
  }
  std::map<const FullyShard*, std::vector<Tensor>> full;
  for (const auto& holder : holders) full[holder.get()] = holder->gather_full_values();
  if (group.rank() != 0) return;
  std::vector<StateEntry> entries;
  entries.reserve(state.size());
  for (const Held& h : state) {
    entries.push_back(h.holder ? StateEntry{h.entry.name, full[h.holder.get()].at(h.index)} : h.entry);
  }
  save_state(entries, {{"format", "pt"}}, path);
}

void refuse_full_state_dict_save(Module& module, const std::string& reason) {
  // The gathers in save_full_state_dict's order; a gather with no collective
  // is skipped there too.
  std::vector<const FullyShard*> seen;
  for (const Held& h : held_state(module)) {
    if (!h.holder || std::find(seen.begin(), seen.end(), h.holder.get()) != seen.end()) continue;
    seen.push_back(h.holder.get());
    h.holder->refuse_gather(reason);
  }
  fail_invalid(reason);
}

namespace {

// A load writes the shards: not while they are read as full parameters (or
// in flight to be), here or, with views, on the other ranks.
void check_resharded(const FullyShard& holder, const std::string& name) {
  if (!holder.resharded()) {
    fail(StatusCode::kState, "parameter '", name,
         "' is unsharded or being unsharded (its slot holds, or is to hold, the full parameter): reshard its dp_fsdp "
         "first");
  }
}

}  // namespace

void load_full_state_dict(Module& module, const std::string& path, bool strict) {
  std::vector<Held> state = held_state(module);
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
  // The file loads into full-size stand-ins; each rank then keeps its rows.
  for (const Swapped& s : swapped) s.parameter->set_value(s.full);
  try {
    load_module(module, path, strict);
  } catch (...) {
    for (const Swapped& s : swapped) s.parameter->set_value(s.holder->shard(s.index));
    throw;
  }
  for (const Swapped& s : swapped) {
    s.holder->load_shard_from_full(s.index, s.full);
    s.parameter->set_value(s.holder->shard(s.index));
  }
}

void save_sharded_state_dict(Module& module, dist::ProcessGroup& group, const std::string& folder) {
  std::vector<Held> state = held_state(module);
  for (const Held& h : state) check_group(h, group);
  if (::mkdir(folder.c_str(), 0777) != 0 && errno != EEXIST) {
    fail(StatusCode::kIo, "cannot make the folder '", folder, "': ", std::strerror(errno));
  }
  const int32_t rank = group.rank(), world = group.size();
  std::map<std::string, std::string> metadata{
      {"format", kShardedFormat}, {"rank", std::to_string(rank)}, {"world", std::to_string(world)}};
  std::vector<StateEntry> entries;
  for (const Held& h : state) {
    const bool sharded = h.holder && !h.holder->full_shape(h.index).empty();
    if (!sharded) {
      // Whole tensors are rank 0's to write.
      if (rank == 0) entries.push_back(StateEntry{h.entry.name, h.holder ? h.holder->shard(h.index) : h.entry.value});
      continue;
    }
    const RowSplit split = h.holder->split_of(h.index, rank);
    metadata[kRowsKey + h.entry.name] =
        str_cat(split.start, " ", split.count, " ", h.holder->full_shape(h.index).front());
    entries.push_back(StateEntry{h.entry.name, h.holder->shard(h.index)});
  }
  save_state(entries, metadata, shard_file(folder, rank, world));
}

void load_sharded_state_dict(Module& module, const std::string& folder) {
  // How many files: rank 0's name says.
  int32_t world = 0;
  if (DIR* dir = ::opendir(folder.c_str())) {
    while (dirent* d = ::readdir(dir)) {
      int32_t n = 0;
      char tail[32] = {};
      if (std::sscanf(d->d_name, "shard-00000-of-%5d.%20s", &n, tail) == 2 && std::string(tail) == "safetensors") {
        if (world != 0 && world != n) {
          ::closedir(dir);
          fail_invalid("the folder '", folder, "' holds shards of two saves (", world, " and ", n, " ranks)");
        }
        world = n;
      }
    }
    ::closedir(dir);
  } else {
    fail(StatusCode::kIo, "cannot open the folder '", folder, "': ", std::strerror(errno));
  }
  if (world <= 0) fail_invalid("the folder '", folder, "' holds no shard-00000-of-N.safetensors");
  // Only the headers are read now; later just the rows this rank keeps.
  std::vector<std::unique_ptr<StateFileReader>> files;
  for (int32_t r = 0; r < world; ++r) {
    files.push_back(std::make_unique<StateFileReader>(shard_file(folder, r, world)));
    const auto& metadata = files.back()->header().metadata;
    auto format = metadata.find("format");
    if (format == metadata.end() || format->second != kShardedFormat) {
      fail_invalid("'", files.back()->path(), "' is not a sharded state dict of dp_fsdp (its metadata has no format \"",
                   kShardedFormat, "\")");
    }
  }
  // Every piece of every key: its file, entry and rows (whole: count -1).
  struct Piece {
    size_t file;
    const safetensors::Entry* entry;
    int64_t first = 0, count = -1, rows = 0;
  };
  std::map<std::string, std::vector<Piece>> pieces;
  for (size_t f = 0; f < files.size(); ++f) {
    const safetensors::Header& header = files[f]->header();
    for (const safetensors::Entry& e : header.entries) {
      Piece p{f, &e};
      auto rows = header.metadata.find(kRowsKey + e.name);
      if (rows != header.metadata.end()) {
        std::istringstream in(rows->second);
        if (!(in >> p.first >> p.count >> p.rows) || p.first < 0 || p.count < 0 || p.first + p.count > p.rows ||
            e.shape.empty() || e.shape[0] != p.count) {
          fail_invalid("'", shard_file(folder, static_cast<int32_t>(f), world), "': the rows of '", e.name,
                       "' are given as \"", rows->second, "\", which its shape ", shape_string(e.shape),
                       " does not match");
        }
      }
      pieces[e.name].push_back(p);
    }
  }
  // Plan every copy first: an error leaves the module unchanged.
  struct Copy {
    Tensor target;
    size_t target_offset;
    size_t file;
    uint64_t offset;  // into the file's data section
    size_t bytes;
  };
  std::vector<Copy> copies;
  std::vector<std::string> problems;
  std::map<std::string, bool> used;
  for (const Held& h : held_state(module)) {
    const std::string& name = h.entry.name;
    auto found = pieces.find(name);
    if (found == pieces.end()) {
      problems.push_back(str_cat("missing key '", name, "'"));
      continue;
    }
    used[name] = true;
    if (h.holder) check_resharded(*h.holder, name);
    const bool sharded = h.holder && !h.holder->full_shape(h.index).empty();
    const Tensor target = h.holder ? h.holder->shard(h.index) : h.entry.value;
    const Shape full = h.holder ? h.holder->full_shape(h.index) : target.shape();
    bool matches = true;
    for (const Piece& p : found->second) {
      Shape piece_full = p.entry->shape;
      if (p.count >= 0) piece_full[0] = p.rows;
      if (p.entry->dtype != target.dtype() || piece_full != full || (p.count >= 0) != sharded) {
        problems.push_back(str_cat("'", name, "' is ", dtype_name(p.entry->dtype), " ", shape_string(piece_full),
                                   p.count >= 0 ? " (sharded)" : "", " in the files but ", dtype_name(target.dtype()),
                                   " ", shape_string(full), sharded ? " (sharded)" : "", " in the module"));
        matches = false;
        break;
      }
    }
    if (!matches) continue;
    if (!sharded) {
      const Piece& p = found->second.front();
      copies.push_back(Copy{target, 0, p.file, p.entry->begin, target.nbytes()});
      continue;
    }
    const RowSplit mine = h.holder->split_of(h.index, h.holder->group()->rank());
    const size_t row_bytes = mine.count > 0 ? target.nbytes() / static_cast<size_t>(mine.count) : 0;
    int64_t covered = 0;
    for (const Piece& p : found->second) {
      const int64_t from = std::max(mine.start, p.first);
      const int64_t to = std::min(mine.start + mine.count, p.first + p.count);
      if (to <= from) continue;
      copies.push_back(Copy{target, static_cast<size_t>(from - mine.start) * row_bytes, p.file,
                            p.entry->begin + static_cast<uint64_t>(from - p.first) * row_bytes,
                            static_cast<size_t>(to - from) * row_bytes});
      covered += to - from;
    }
    if (covered != mine.count) {
      problems.push_back(str_cat("the files hold ", covered, " of the ", mine.count, " rows of '", name,
                                 "' this rank keeps (rows ", mine.start, " to ", mine.start + mine.count, ")"));
    }
  }
  for (const auto& [name, list] : pieces) {
    if (used.count(name) == 0) problems.push_back(str_cat("unexpected key '", name, "'"));
  }
  if (!problems.empty()) {
    std::string text;
    for (const std::string& p : problems) text += (text.empty() ? "" : "; ") + p;
    fail_invalid("error loading the sharded state dict in '", folder, "' into the module: ", text);
  }
  // A read that fails now (a file changed meanwhile) is kIo and may leave
  // the module partly loaded, as dp_module_load.
  std::vector<uint8_t> staging;
  for (const Copy& c : copies) files[c.file]->read_into(c.target, c.target_offset, c.offset, c.bytes, staging);
}

}  // namespace dparallel::fsdp
