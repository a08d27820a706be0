#include "fsdp/save_manifest.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "core/error.h"
#include "module/checksum.h"

namespace dparallel::fsdp {

namespace {

using Json = nlohmann::json;

constexpr const char* kFormat = "dp-fsdp-sharded-manifest";
constexpr int64_t kVersion = 1;
constexpr size_t kSaveIdDigits = 16;
// A world size no job reaches; it bounds what a hostile manifest can ask for.
constexpr int64_t kMaxWorld = 1 << 20;

class Reader {
 public:
  explicit Reader(const std::string& origin) : origin_(origin) {}

  template <typename... Args>
  [[noreturn]] void bad(Args&&... args) const {
    fail(StatusCode::kIo, "'", origin_, "' is not a valid manifest: ", std::forward<Args>(args)...);
  }
  const Json& field(const Json& object, const char* name, const std::string& where) const {
    auto it = object.find(name);
    if (it == object.end()) bad(where, " has no \"", name, "\"");
    return *it;
  }
  std::string text(const Json& object, const char* name, const std::string& where) const {
    const Json& v = field(object, name, where);
    if (!v.is_string()) bad(where, "'s \"", name, "\" is not a string");
    return v.get<std::string>();
  }
  int64_t integer(const Json& object, const char* name, const std::string& where, int64_t low, int64_t high) const {
    const Json& v = field(object, name, where);
    if (!v.is_number_integer()) bad(where, "'s \"", name, "\" is not an integer");
    // Unsigned values past int64's range are refused by the bound below.
    const int64_t n = v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX) ? -1 : v.get<int64_t>();
    if (n < low || n > high) bad(where, "'s \"", name, "\" is ", v.dump(), ", not in [", low, ", ", high, "]");
    return n;
  }
  uint32_t crc(const Json& object, const char* name, const std::string& where) const {
    uint32_t value = 0;
    if (!parse_crc32c(text(object, name, where), &value)) bad(where, "'s \"", name, "\" is not eight hex digits");
    return value;
  }

 private:
  const std::string& origin_;
};

}  // namespace

bool is_save_id(const std::string& id) {
  return id.size() == kSaveIdDigits &&
         std::all_of(id.begin(), id.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

std::string new_save_id() {
  std::random_device device;
  char id[kSaveIdDigits + 1];
  std::snprintf(id, sizeof id, "%08x%08x", static_cast<unsigned>(device()), static_cast<unsigned>(device()));
  return id;
}

std::string shard_file_name(int32_t rank, int32_t world, const std::string& save_id) {
  char name[64];
  std::snprintf(name, sizeof name, "shard-%05d-of-%05d-", rank, world);
  return name + save_id + ".safetensors";
}

bool parse_shard_file_name(const std::string& name, std::string* save_id) {
  int rank = 0, world = 0, used = 0;
  char id[kSaveIdDigits + 1] = {};
  if (std::sscanf(name.c_str(), "shard-%5d-of-%5d-%16[0-9a-f].safetensors%n", &rank, &world, id, &used) != 3 ||
      static_cast<size_t>(used) != name.size() || !is_save_id(id)) {
    return false;
  }
  if (name != shard_file_name(rank, world, id)) return false;
  *save_id = id;
  return true;
}

std::string encode_manifest(const Manifest& manifest) {
  Json files = Json::array();
  for (const ManifestFile& f : manifest.files) {
    files.push_back({{"name", f.name}, {"bytes", f.bytes}, {"header_crc32c", crc32c_text(f.header_crc)}});
  }
  Json tensors = Json::array();
  for (const ManifestTensor& t : manifest.tensors) {
    Json pieces = Json::array();
    for (const ManifestPiece& p : t.pieces) {
      Json piece = {{"file", p.file}, {"crc32c", crc32c_text(p.crc)}};
      if (t.rows >= 0) {
        piece["first_row"] = p.first_row;
        piece["row_count"] = p.row_count;
      }
      pieces.push_back(std::move(piece));
    }
    Json tensor = {{"name", t.name}, {"pieces", std::move(pieces)}};
    if (t.rows >= 0) tensor["rows"] = t.rows;
    tensors.push_back(std::move(tensor));
  }
  Json out = {{"format", kFormat},           {"version", kVersion},
              {"save_id", manifest.save_id}, {"world_size", manifest.world_size},
              {"files", std::move(files)},   {"tensors", std::move(tensors)}};
  return out.dump(1) + "\n";
}

Manifest parse_manifest(const std::string& text, const std::string& origin) {
  Reader r(origin);
  Json root = Json::parse(text, nullptr, false);
  if (root.is_discarded()) r.bad("it is not JSON");
  if (!root.is_object()) r.bad("it is not a JSON object");
  if (r.text(root, "format", "it") != kFormat) r.bad("its \"format\" is not \"", kFormat, "\"");
  const int64_t version = r.integer(root, "version", "it", 1, INT64_MAX);
  if (version != kVersion) r.bad("it is version ", version, "; this dparallel reads version ", kVersion);
  Manifest m;
  m.save_id = r.text(root, "save_id", "it");
  if (!is_save_id(m.save_id)) r.bad("its save id \"", m.save_id, "\" is not ", kSaveIdDigits, " hex digits");
  m.world_size = static_cast<int32_t>(r.integer(root, "world_size", "it", 1, kMaxWorld));
  const Json& files = r.field(root, "files", "it");
  if (!files.is_array() || files.size() != static_cast<size_t>(m.world_size)) {
    r.bad("\"files\" is not a list of world_size (", m.world_size, ") files");
  }
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string where = str_cat("file ", i);
    if (!files[i].is_object()) r.bad(where, " is not an object");
    ManifestFile f;
    f.name = r.text(files[i], "name", where);
    const std::string expected = shard_file_name(static_cast<int32_t>(i), m.world_size, m.save_id);
    if (f.name != expected) r.bad(where, " is named \"", f.name, "\" where this save's is \"", expected, "\"");
    f.bytes = static_cast<uint64_t>(r.integer(files[i], "bytes", where, 8, INT64_MAX));
    f.header_crc = r.crc(files[i], "header_crc32c", where);
    m.files.push_back(std::move(f));
  }
  const Json& tensors = r.field(root, "tensors", "it");
  if (!tensors.is_array()) r.bad("\"tensors\" is not a list");
  std::set<std::string> names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].is_object()) r.bad("tensor ", i, " is not an object");
    ManifestTensor t;
    t.name = r.text(tensors[i], "name", str_cat("tensor ", i));
    const std::string where = "tensor '" + t.name + "'";
    if (!names.insert(t.name).second) r.bad(where, " is listed twice");
    const bool sharded = tensors[i].contains("rows");
    if (sharded) t.rows = r.integer(tensors[i], "rows", where, 0, INT64_MAX);
    const Json& pieces = r.field(tensors[i], "pieces", where);
    if (!pieces.is_array()) r.bad(where, "'s \"pieces\" is not a list");
    for (size_t k = 0; k < pieces.size(); ++k) {
      const std::string piece_where = str_cat(where, "'s piece ", k);
      if (!pieces[k].is_object()) r.bad(piece_where, " is not an object");
      ManifestPiece p;
      p.file = static_cast<size_t>(r.integer(pieces[k], "file", piece_where, 0, m.world_size - 1));
      p.crc = r.crc(pieces[k], "crc32c", piece_where);
      if (sharded) {
        p.first_row = r.integer(pieces[k], "first_row", piece_where, 0, t.rows);
        p.row_count = r.integer(pieces[k], "row_count", piece_where, 0, t.rows - p.first_row);
      }
      t.pieces.push_back(p);
    }
    if (!sharded) {
      if (t.pieces.size() != 1) r.bad(where, " is whole but has ", t.pieces.size(), " pieces");
    } else {
      // The row ranges tile [0, rows) exactly: sorted, each starts where the last ended.
      std::vector<const ManifestPiece*> order;
      for (const ManifestPiece& p : t.pieces) {
        if (p.row_count > 0) order.push_back(&p);
      }
      std::sort(order.begin(), order.end(),
                [](const ManifestPiece* a, const ManifestPiece* b) { return a->first_row < b->first_row; });
      int64_t next = 0;
      const ManifestPiece* last = nullptr;
      for (const ManifestPiece* p : order) {
        if (p->first_row < next) {
          r.bad(where, "'s rows ", p->first_row, " to ", std::min(next, p->first_row + p->row_count),
                " are in two files (", m.files[last->file].name, " and ", m.files[p->file].name, ")");
        }
        if (p->first_row > next) r.bad(where, "'s rows ", next, " to ", p->first_row, " are in no file");
        next = p->first_row + p->row_count;
        last = p;
      }
      if (next != t.rows) r.bad(where, "'s rows ", next, " to ", t.rows, " are in no file");
    }
    m.tensors.push_back(std::move(t));
  }
  return m;
}

}  // namespace dparallel::fsdp
