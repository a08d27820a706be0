// The manifest of a sharded state dict: what makes a folder of rank files
// one complete save. Rank 0 writes it last (manifest.json, atomically),
// once every rank's file is on disk; a load trusts only what it names.
//
// It holds the save's id (which every file's metadata repeats and its name
// carries), the world size, every file's size and header checksum, and
// every tensor's pieces: which file, which rows of how many, and the
// checksum of the piece's bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dparallel::fsdp {

inline constexpr const char* kManifestName = "manifest.json";

struct ManifestFile {
  std::string name;  // in the save's folder
  uint64_t bytes = 0;
  uint32_t header_crc = 0;
};

struct ManifestPiece {
  size_t file = 0;         // index into Manifest::files: the rank that wrote it
  int64_t first_row = -1;  // -1 for a whole tensor
  int64_t row_count = -1;
  uint32_t crc = 0;  // of the piece's bytes
};

struct ManifestTensor {
  std::string name;
  int64_t rows = -1;  // the full tensor's rows when sharded, else -1
  std::vector<ManifestPiece> pieces;
};

struct Manifest {
  std::string save_id;
  int32_t world_size = 0;
  std::vector<ManifestFile> files;      // rank order
  std::vector<ManifestTensor> tensors;  // names unique
};

// A fresh save id: 16 lowercase hex digits.
std::string new_save_id();
bool is_save_id(const std::string& id);
// Rank `rank`'s file name in a save of `world` ranks with id `save_id`.
std::string shard_file_name(int32_t rank, int32_t world, const std::string& save_id);
// Whether `name` is a rank file of a save (any id); its id when so.
bool parse_shard_file_name(const std::string& name, std::string* save_id);

std::string encode_manifest(const Manifest& manifest);
// Parses and checks a manifest's text (trusting nothing): kIo naming
// `origin` and the first problem. Checked: the fields and their types, the
// file names (each rank's expected name for the id), pieces that name a
// file, and every sharded tensor's row ranges tiling its rows exactly (no
// overlap, no gap); a whole tensor has exactly one piece.
Manifest parse_manifest(const std::string& text, const std::string& origin);

}  // namespace dparallel::fsdp
