// The sharded load's plan (sharded_load_plan.h).
#include "fsdp/sharded_load_plan.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <set>

#include "core/error.h"

namespace dparallel::fsdp {

namespace {

// A manifest larger than this is not one a save wrote.
constexpr int64_t kMaxManifestBytes = int64_t(1) << 30;

std::string read_manifest_text(const std::string& folder) {
  const std::string path = folder + "/" + kManifestName;
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    if (errno != ENOENT) fail(StatusCode::kIo, "cannot stat '", path, "': ", std::strerror(errno));
    struct stat folder_info {};
    if (::stat(folder.c_str(), &folder_info) != 0 || !S_ISDIR(folder_info.st_mode)) {
      fail(StatusCode::kIo, "cannot open the folder '", folder, "': ", std::strerror(ENOENT));
    }
    fail_invalid("the folder '", folder, "' holds no complete sharded save: it has no ", kManifestName,
                 ", which a save writes last, once every rank's file is written");
  }
  if (!S_ISREG(info.st_mode)) fail_invalid("'", path, "' is not a regular file");
  if (info.st_size > kMaxManifestBytes) {
    fail(StatusCode::kIo, "'", path, "' is ", info.st_size, " bytes, more than any manifest a save writes");
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(StatusCode::kIo, "cannot open '", path, "': ", std::strerror(errno));
  std::string text(static_cast<size_t>(info.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int saved = n < 0 ? errno : EIO;
      ::close(fd);
      fail(StatusCode::kIo, "cannot read '", path, "': ", std::strerror(saved));
    }
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  return text;
}

// Opens every file of the save and checks it is the one the manifest names:
// its size, its header's checksum, the save's id, its rank and world size.
std::vector<std::unique_ptr<StateFileReader>> open_save_files(const std::string& folder, const Manifest& m) {
  std::vector<std::unique_ptr<StateFileReader>> files;
  for (size_t r = 0; r < m.files.size(); ++r) {
    const ManifestFile& f = m.files[r];
    files.push_back(std::make_unique<StateFileReader>(folder + "/" + f.name));
    const StateFileReader& file = *files.back();
    if (file.file_size() != f.bytes) {
      fail(StatusCode::kIo, "'", file.path(), "' is ", file.file_size(), " bytes, but save ", m.save_id, " wrote ",
           f.bytes, ": it is not that save's file, or it is damaged");
    }
    const auto& metadata = file.header().metadata;
    auto value = [&](const char* key) {
      auto it = metadata.find(key);
      return it == metadata.end() ? std::string("(none)") : it->second;
    };
    if (value("format") != kShardedFormat || value(kSaveIdKey) != m.save_id || value("rank") != std::to_string(r) ||
        value("world") != std::to_string(m.world_size)) {
      fail(StatusCode::kIo, "'", file.path(), "' is not rank ", r, "'s file of save ", m.save_id, " (", m.world_size,
           " ranks): its metadata says format ", value("format"), ", save ", value(kSaveIdKey), ", rank ",
           value("rank"), " of ", value("world"));
    }
    if (file.header_crc() != f.header_crc) {
      fail(StatusCode::kIo, "'", file.path(), "' is damaged: its header differs from its checksum in the manifest");
    }
  }
  return files;
}

// One piece of a tensor as a file holds it, checked against the manifest.
struct Piece {
  size_t file = 0;
  const safetensors::Entry* entry = nullptr;
  int64_t first = 0, count = -1, rows = 0;  // whole: count -1
  uint32_t crc = 0;
};

std::map<std::string, std::vector<Piece>> match_pieces(const Manifest& m,
                                                       const std::vector<std::unique_ptr<StateFileReader>>& files) {
  std::vector<std::map<std::string, const safetensors::Entry*>> entries(files.size());
  for (size_t f = 0; f < files.size(); ++f) {
    for (const safetensors::Entry& e : files[f]->header().entries) entries[f][e.name] = &e;
  }
  std::map<std::string, std::vector<Piece>> pieces;
  std::vector<std::set<std::string>> listed(files.size());
  for (const ManifestTensor& t : m.tensors) {
    for (const ManifestPiece& mp : t.pieces) {
      const StateFileReader& file = *files[mp.file];
      auto found = entries[mp.file].find(t.name);
      if (found == entries[mp.file].end()) {
        fail(StatusCode::kIo, "'", file.path(), "' has no tensor '", t.name, "', which the manifest says it holds");
      }
      listed[mp.file].insert(t.name);
      Piece p{mp.file, found->second, mp.first_row, mp.row_count, t.rows, mp.crc};
      const auto& metadata = file.header().metadata;
      auto rows = metadata.find(kRowsKey + t.name);
      const std::string stated = t.rows >= 0 ? str_cat(p.first, " ", p.count, " ", p.rows) : std::string("(none)");
      const std::string in_file = rows == metadata.end() ? std::string("(none)") : rows->second;
      const Shape& shape = p.entry->shape;
      if (stated != in_file || (t.rows >= 0 && (shape.empty() || shape[0] != p.count))) {
        fail(StatusCode::kIo, "'", file.path(), "': the rows of '", t.name, "' are ", in_file, " with shape ",
             shape_string(shape), " in the file but ", stated, " in the manifest");
      }
      std::vector<Piece>& list = pieces[t.name];
      if (!list.empty()) {
        const safetensors::Entry& first = *list.front().entry;
        if (first.dtype != p.entry->dtype || first.shape.size() != shape.size() ||
            !std::equal(shape.begin() + (t.rows >= 0 ? 1 : 0), shape.end(),
                        first.shape.begin() + (t.rows >= 0 ? 1 : 0))) {
          fail(StatusCode::kIo, "the pieces of '", t.name, "' differ: ", dtype_name(first.dtype), " ",
               shape_string(first.shape), " in '", files[list.front().file]->path(), "' but ",
               dtype_name(p.entry->dtype), " ", shape_string(shape), " in '", file.path(), "'");
        }
      }
      list.push_back(p);
    }
  }
  for (size_t f = 0; f < files.size(); ++f) {
    for (const auto& [name, entry] : entries[f]) {
      if (listed[f].count(name) == 0) {
        fail(StatusCode::kIo, "'", files[f]->path(), "' holds '", name, "', which the manifest does not list");
      }
    }
  }
  return pieces;
}

}  // namespace

ShardedLoad plan_sharded_load(const std::vector<Held>& state, const std::string& folder) {
  const Manifest m = parse_manifest(read_manifest_text(folder), folder + "/" + kManifestName);
  ShardedLoad plan;
  plan.files = open_save_files(folder, m);
  const std::map<std::string, std::vector<Piece>> pieces = match_pieces(m, plan.files);
  std::vector<std::string> problems;
  std::set<std::string> used;
  std::set<const Piece*> read;
  for (const Held& h : state) {
    const std::string& name = h.entry.name;
    auto found = pieces.find(name);
    if (found == pieces.end() || found->second.empty()) {
      problems.push_back(str_cat("missing key '", name, "'"));
      continue;
    }
    used.insert(name);
    if (h.holder) check_resharded(*h.holder, name);
    const bool sharded = h.sharded();
    const Tensor target = h.holder ? h.holder->shard(h.index) : h.entry.value;
    const Shape full = h.holder ? h.holder->full_shape(h.index) : target.shape();
    const Piece& first = found->second.front();
    Shape piece_full = first.entry->shape;
    if (first.count >= 0) piece_full[0] = first.rows;
    if (first.entry->dtype != target.dtype() || piece_full != full || (first.count >= 0) != sharded) {
      problems.push_back(str_cat("'", name, "' is ", dtype_name(first.entry->dtype), " ", shape_string(piece_full),
                                 first.count >= 0 ? " (sharded)" : "", " in the files but ", dtype_name(target.dtype()),
                                 " ", shape_string(full), sharded ? " (sharded)" : "", " in the module"));
      continue;
    }
    if (!sharded) {
      plan.copies.push_back(Copy{target, 0, first.file, first.entry->begin, target.nbytes()});
      read.insert(&first);
      continue;
    }
    // The manifest's rows tile the tensor: the pieces cover this rank's rows once.
    const RowSplit mine = h.holder->split_of(h.index, h.holder->group()->rank());
    const size_t row_bytes = mine.count > 0 ? target.nbytes() / static_cast<size_t>(mine.count) : 0;
    for (const Piece& p : found->second) {
      const int64_t from = std::max(mine.start, p.first);
      const int64_t to = std::min(mine.start + mine.count, p.first + p.count);
      if (to <= from) continue;
      plan.copies.push_back(Copy{target, static_cast<size_t>(from - mine.start) * row_bytes, p.file,
                                 p.entry->begin + static_cast<uint64_t>(from - p.first) * row_bytes,
                                 static_cast<size_t>(to - from) * row_bytes});
      read.insert(&p);
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
  // Every piece read, whole: the copies take only the rows this rank keeps.
  std::vector<uint8_t> staging;
  for (const Piece* p : read) {
    const StateFileReader& file = *plan.files[p->file];
    if (file.data_crc(p->entry->begin, p->entry->end - p->entry->begin, staging) != p->crc) {
      fail(StatusCode::kIo, "'", file.path(), "' is damaged: the bytes of '", p->entry->name,
           "' differ from their checksum in the manifest");
    }
  }
  return plan;
}

}  // namespace dparallel::fsdp
