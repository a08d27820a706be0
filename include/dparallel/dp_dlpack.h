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

/* ---- DLPack 1.x: DLManagedTensorVersioned, with its version and flags ----
 *
 * Only declared, as above: a DLPack >= 1.0 <dlpack/dlpack.h> defines it. For
 * a host whose <dlpack/dlpack.h> is older (0.x: it defines DLTensor but
 * no DLPACK_MAJOR_VERSION) and included before this header, the
 * definitions below give the 1.x layout (field for field as DLPack 1.x
 * lays it out), so that such a host can build and read one too. */
struct DLManagedTensorVersioned;

#if defined(DLPACK_VERSION) && !defined(DLPACK_MAJOR_VERSION)
typedef struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
} DLPackVersion;
typedef struct DLManagedTensorVersioned {
  DLPackVersion version;
  void *manager_ctx;
  void (*deleter)(struct DLManagedTensorVersioned *self);
  uint64_t flags;
  DLTensor dl_tensor;
} DLManagedTensorVersioned;
#define DLPACK_FLAG_BITMASK_READ_ONLY (UINT64_C(1) << 0)
#define DLPACK_FLAG_BITMASK_IS_COPIED (UINT64_C(1) << 1)
#define DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED (UINT64_C(1) << 2)
#endif

/* The DLPack version this library writes into an export: 1.1. */
#define DP_DLPACK_VERSIONED_MAJOR 1
#define DP_DLPACK_VERSIONED_MINOR 1

/* A DLManagedTensorVersioned over the tensor's memory (zero-copy), version
 * DP_DLPACK_VERSIONED_MAJOR.DP_DLPACK_VERSIONED_MINOR, flags
 * DLPACK_FLAG_BITMASK_READ_ONLY when `read_only` is nonzero and none else
 * (never IS_COPIED: it is the tensor's own memory; no sub-byte dtypes).
 * The caller owns it and calls out->deleter(out) when done; the memory
 * stays alive until then, even after dp_tensor_destroy(tensor). READ_ONLY
 * tells the consumer not to write through it; the library itself still
 * writes the tensor where its calls do (a collective on it, say), so
 * export read-only what the host only reads meanwhile. */
DP_API dp_status dp_tensor_to_dlpack_versioned(const dp_tensor *tensor, int read_only,
                                               struct DLManagedTensorVersioned **out);
/* Imports a DLPack 1.x tensor; the checks of dp_tensor_from_dlpack apply,
 * and a major version other than 1 is DP_EINVAL naming the version (a
 * higher minor is accepted: DLPack keeps the layout within a major).
 * Without DLPACK_FLAG_BITMASK_READ_ONLY it takes ownership of `managed` on
 * success: the new tensor uses its memory in place and calls
 * managed->deleter(managed) (when not NULL) as its last tensor is
 * destroyed. A read-only tensor is copied instead, since the library
 * writes tensors in place (collectives, optimizers through the handles):
 * the new tensor holds a copy in memory of its own, and managed->deleter
 * runs before the call returns; the producer's memory is never written.
 * On failure nothing is taken: the caller still owns `managed` and must
 * call its deleter. */
DP_API dp_status dp_tensor_from_dlpack_versioned(dp_tensor **out, struct DLManagedTensorVersioned *managed);

#ifdef __cplusplus
}
#endif

#endif /* DPARALLEL_DP_DLPACK_H */
