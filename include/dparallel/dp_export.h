/* dparallel — the one export macro. */
#ifndef DPARALLEL_DP_EXPORT_H
#define DPARALLEL_DP_EXPORT_H

#if defined(DP_BUILDING_LIBRARY)
#define DP_API __attribute__((visibility("default")))
#else
#define DP_API
#endif

#endif /* DPARALLEL_DP_EXPORT_H */
