// State dicts of a module whose parameters dp_fsdp hold. Every save is a
// transaction: it fails on every rank or succeeds on every rank, and a
// failed one leaves what was there before loadable.
//
// Full: every rank gathers each sharded parameter (one all-gather per
// dp_fsdp, on its lane) and `group`'s rank 0 writes what dp_module_save
// writes for the unsharded module (through a temporary file renamed into
// place, with its data's checksum); rank 0's outcome is every rank's. Every
// rank can load such a file and keeps its rows.
//
// Sharded: each rank writes its own file in a folder,
// shard-RRRRR-of-WWWWW-<save id>.safetensors, holding its rows of every
// sharded parameter (metadata "dp.rows.<name>" = "first count rows", and
// the save's id); rank 0's also holds every tensor that is not sharded.
// Once every rank reported its file written, rank 0 writes manifest.json
// (save_manifest.h) last and removes the files of earlier saves. Loading
// checks the manifest and every file against it, then reads only the rows
// this rank keeps now (at any world size) and the whole tensors, each piece
// it reads checked against its checksum first.
//
// HSDP (a dp_fsdp with a replicate group; `group` is then its shard group):
// the replicas hold the same shards, so a sharded save is written once, by
// the shard group of the replicate group's rank 0 (its files and manifest
// are a plain fully_shard save over the shard group); the other replicas
// write nothing but take part, and every rank of both groups gets the same
// outcome. A full save is written by rank 0 of both groups. A sharded save
// loads under any mesh, each rank reading the rows of its shard; a load
// fails, or succeeds, on every rank of both groups.
#pragma once

#include <memory>
#include <string>

#include "distributed/process_group.h"
#include "module/module.h"

namespace dparallel::fsdp {

// Collective over the ranks of the dp_fsdp's groups (each must be `group`).
void save_full_state_dict(Module& module, dist::ProcessGroup& group, const std::string& path);
// save_full_state_dict refused on this rank for `reason` (an argument error):
// in the place of its first collective (a gather, or the outcomes'
// exchange), so that the other ranks' save fails naming this rank. Throws
// kInvalidArgument.
[[noreturn]] void refuse_full_state_dict_save(Module& module, dist::ProcessGroup& group, const std::string& reason);
// Collective over `group`, as save_full_state_dict up to the write: on rank
// `root` (every rank for -1) a new module of the module's state dict, every
// sharded parameter gathered, every tensor a copy in cpu memory, under the
// same dotted names (parameters as parameters with their requires_grad,
// buffers as persistent buffers); null elsewhere. A rank that cannot build
// it fails every rank's call, named. refuse_full_state_dict_save stands in
// for it on a rank with an argument error.
std::shared_ptr<Module> full_state_dict(Module& module, dist::ProcessGroup& group, int32_t root);
// Local: every tensor of the file, the sharded parameters' rows of this
// rank only; without `strict`, what the file lacks is left as it is.
// `strict` as for dp_module_load. The dp_fsdp must be resharded.
void load_full_state_dict(Module& module, const std::string& path, bool strict);

// Collective over `group`: this rank's file in `folder` (made when
// missing), then the manifest. With a `refusal` (this rank's argument
// error), the rank writes nothing and its refusal fails every rank's save
// in the place of its report, naming it.
void save_sharded_state_dict(Module& module, dist::ProcessGroup& group, const std::string& folder,
                             const std::string& refusal = "");
// Collective over the group of the dp_fsdp holding the module's tensors
// (local when none does): a folder without a complete save, or whose files
// differ from its manifest, is refused (kInvalidArgument or kIo naming the
// file and tensor); every key must name a tensor of the module and every
// tensor must be covered, else kInvalidArgument naming them. A refusal on
// any rank is every rank's, and the module is unchanged then.
// With a `refusal`, this rank reads nothing and the load fails on every rank.
void load_sharded_state_dict(Module& module, const std::string& folder, const std::string& refusal = "");

}  // namespace dparallel::fsdp
