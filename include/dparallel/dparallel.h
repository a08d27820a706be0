/* dparallel — the umbrella header: every public header of the C ABI. */
#ifndef DPARALLEL_DPARALLEL_H
#define DPARALLEL_DPARALLEL_H

#include "dparallel/dp_api.h"
#include "dparallel/dp_base.h"
#include "dparallel/dp_comm.h"
#include "dparallel/dp_ddp.h"
#include "dparallel/dp_dist.h"
#include "dparallel/dp_dlpack.h"
#include "dparallel/dp_fsdp.h"
#include "dparallel/dp_module.h"
#include "dparallel/dp_parallel.h"
#include "dparallel/dp_replicate.h"
#include "dparallel/dp_stream.h"
#include "dparallel/dp_tensor.h"

#endif /* DPARALLEL_DPARALLEL_H */
