// A sharded save in the background (DCP's async_save): the calling thread
// copies this rank's part of the save aside, into cpu memory of the
// save's own, and a library thread per group writes the files, the group's
// saves in the order they were started. The ranks agree on the outcome through
// the group's store, never through the group itself (which the host keeps
// driving meanwhile): under keys of the save's own (the group's prefix,
// "async_save/<n>/", n counting the group's saves on every rank alike),
// each rank posts how its file went; rank 0 writes the manifest once every
// rank's file is written, then posts the verdict. Every wait ends by the
// group's timeout, so a rank that dies leaves the others' work failed, not
// hanging. The files and manifest are the synchronous save's
// (fsdp_state_dict.h): a load takes either alike.
#pragma once

#include <memory>
#include <string>

#include "distributed/process_group.h"
#include "distributed/work.h"
#include "module/module.h"

namespace dparallel::fsdp {

// Copies the save aside and queues its writing; the Work finishes with the
// save's outcome, the same on every rank. With a `refusal` (this rank's
// argument error; `module` may then be null), or when the module cannot be
// saved so, this rank posts the refusal as its outcome, so that the others'
// saves fail naming it, and throws it. kState, posting nothing, for a group
// without a store of its own (one made inside another group's backend).
std::shared_ptr<dist::Work> save_sharded_state_dict_async(Module* module,
                                                          const std::shared_ptr<dist::ProcessGroup>& group,
                                                          const std::string& folder, const std::string& refusal);

}  // namespace dparallel::fsdp
