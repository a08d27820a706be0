/* dparallel — DLPack exchange (the DLManagedTensor protocol).
 *
 * Thread safety: as for dp_tensor.h.
 */
#ifndef DPARALLEL_DP_DLPACK_H
#define DPARALLEL_DP_DLPACK_H

#include "dparallel/dp_tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* DLPack's struct, only declared: this header compiles without DLPack's.
 * A host that builds or reads a DLManagedTensor includes <dlpack/dlpack.h>. */
struct DLManagedTensor;

/* Takes ownership of `managed` on success: the new tensor uses its memory in
 * place and calls managed->deleter(managed) when its last tensor is
 * destroyed. The tensor must be compact row-major (strides NULL or matching),
 * on a CPU or CUDA device, with a dtype dparallel knows (bool as DLPack's
 * code 6 with 8 bits). On failure nothing is taken: the caller still owns
 * `managed` and must call its deleter. */
DP_API dp_status dp_tensor_from_dlpack(dp_tensor **out, struct DLManagedTensor *managed);
/* A DLManagedTensor over the tensor's memory (zero-copy). The caller owns it
 * and calls out->deleter(out) when done; the memory stays alive until then,
 * even after dp_tensor_destroy(tensor). */
DP_API dp_status dp_tensor_to_dlpack(const dp_tensor *tensor, struct DLManagedTensor **out);

#ifdef __cplusplus
}
#endif

#endif /* DPARALLEL_DP_DLPACK_H */
