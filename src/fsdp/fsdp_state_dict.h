// State dicts of a module whose parameters dp_fsdp hold.
//
// Full: every rank gathers each sharded parameter (one all-gather per
// dp_fsdp, on its lane) and `group`'s rank 0 writes what dp_module_save
// writes for the unsharded module. Every rank can load such a file and keeps
// its rows.
//
// Sharded: each rank writes its own file in a folder,
// shard-RRRRR-of-WWWWW.safetensors, holding its rows of every sharded
// parameter (metadata "dp.rows.<name>" = "first count rows"); rank 0's also
// holds every tensor that is not sharded. Loading reads every file's
// header, then only the rows this rank keeps now (at any world size) and
// the whole tensors.
#pragma once

#include <string>

#include "distributed/process_group.h"
#include "module/module.h"

namespace dparallel::fsdp {

// Collective over the ranks of the dp_fsdp's groups (each must be `group`).
void save_full_state_dict(Module& module, dist::ProcessGroup& group, const std::string& path);
// save_full_state_dict refused on this rank for `reason` (an argument error):
// in the place of its first gather that makes a collective, so that the
// other ranks' save fails naming this rank. Throws kInvalidArgument.
[[noreturn]] void refuse_full_state_dict_save(Module& module, const std::string& reason);
// Local: every tensor of the file, the sharded parameters' rows of this
// rank only. `strict` as for dp_module_load. The dp_fsdp must be resharded.
void load_full_state_dict(Module& module, const std::string& path, bool strict);

// Local: this rank's file in `folder` (made when missing).
void save_sharded_state_dict(Module& module, dist::ProcessGroup& group, const std::string& folder);
// Local: every key of the files must name a tensor of the module and every
// tensor must be covered, else kInvalidArgument naming them; the module is
// unchanged then.
void load_sharded_state_dict(Module& module, const std::string& folder);

}  // namespace dparallel::fsdp
