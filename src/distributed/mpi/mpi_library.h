// The site's MPI library, loaded with dlopen the first time a group asks
// for DP_BACKEND_MPI: libdparallel neither links nor includes MPI, and a
// process that never asks for it never maps it.
//
// The MPI ABI differs between implementations: Open MPI's handles are
// pointers to its predefined objects (found with dlsym), MPICH's (and the
// libraries built on its ABI) are ints with fixed values. MpiApi<Handle>
// holds one implementation's entry points and constants; the backend is a
// template over the handle type. Other implementations are refused.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>

#include "core/device.h"
#include "core/error.h"
#include "core/process_origin.h"

namespace dparallel::dist {

enum class MpiFlavor : int32_t { kOpenMpi, kMpich };

// The entry points and constants the backend uses, for an implementation
// whose handles (communicators, groups, datatypes, ops, requests, error
// handlers) are `Handle`.
template <typename Handle>
struct MpiApi {
  using UserFunction = void (*)(void* in, void* inout, int* len, Handle* datatype);

  int (*comm_rank)(Handle comm, int* rank) = nullptr;
  int (*comm_size)(Handle comm, int* size) = nullptr;
  int (*comm_group)(Handle comm, Handle* group) = nullptr;
  int (*group_incl)(Handle group, int n, const int* ranks, Handle* out) = nullptr;
  int (*group_free)(Handle* group) = nullptr;
  int (*comm_create_group)(Handle comm, Handle group, int tag, Handle* out) = nullptr;
  int (*comm_free)(Handle* comm) = nullptr;
  int (*comm_set_errhandler)(Handle comm, Handle handler) = nullptr;
  int (*test)(Handle* request, int* done, void* status) = nullptr;
  int (*iallreduce)(const void* send, void* recv, int count, Handle type, Handle op, Handle comm,
                    Handle* request) = nullptr;
  int (*ibcast)(void* data, int count, Handle type, int root, Handle comm, Handle* request) = nullptr;
  int (*iallgather)(const void* send, int send_count, Handle send_type, void* recv, int recv_count, Handle recv_type,
                    Handle comm, Handle* request) = nullptr;
  int (*ireduce_scatter_block)(const void* send, void* recv, int count, Handle type, Handle op, Handle comm,
                               Handle* request) = nullptr;
  int (*op_create)(UserFunction function, int commute, Handle* op) = nullptr;

  Handle comm_world{};
  Handle comm_null{};
  Handle request_null{};
  Handle errors_return{};
  Handle type_byte{};
  Handle type_float{};
  Handle type_double{};
  Handle type_int8{};
  Handle type_uint8{};
  Handle type_int16{};
  Handle type_int32{};
  Handle type_int64{};
  Handle op_sum{};
  Handle op_prod{};
  Handle op_min{};
  Handle op_max{};
  void* in_place = nullptr;
};

// The process's MPI: loaded, identified and initialised once.
class MpiLibrary {
 public:
  // The library, loading and initialising it on first use (DP_MPI_LIBRARY,
  // else the usual sonames, the launcher's implementation first). Throws
  // kUnsupported saying what was tried when none loads or it is neither
  // Open MPI nor MPICH, and when MPI was finalised or runs at a thread
  // level below MPI_THREAD_SERIALIZED.
  static MpiLibrary& get();
  // Loaded already in this process (without loading it).
  static bool loaded();
  // MPI_Finalize, when this library initialised MPI and no group uses it;
  // later groups then fail (MPI cannot start twice in a process). At exit and
  // dp_shutdown; never in a forked child.
  static void finalize_if_ours() noexcept;

  MpiFlavor flavor() const { return flavor_; }
  const std::string& path() const { return path_; }
  // MPI_Get_library_version's first line.
  const std::string& version() const { return version_; }
  // MPI_Init_thread's (or the host's) thread level.
  int thread_level() const { return thread_level_; }

  const MpiApi<void*>& open_mpi() const { return open_mpi_; }
  const MpiApi<int>& mpich() const { return mpich_; }

  // Every MPI call from dparallel holds this when the thread level is
  // SERIALIZED (no lock needed at MULTIPLE).
  std::unique_lock<std::mutex> serialize();
  // MPI_Error_string of `code`, or the code.
  std::string error_string(int code) const;

  // Groups alive over it (finalize waits for none).
  void add_group();
  void remove_group();

  MpiLibrary(const MpiLibrary&) = delete;
  MpiLibrary& operator=(const MpiLibrary&) = delete;

 private:
  MpiLibrary() = default;
  void load();
  void initialise();
  void* symbol(const char* name) const;
  template <typename Handle>
  void bind_functions(MpiApi<Handle>& api) const;

  void* dl_ = nullptr;
  std::string path_;
  std::string version_;
  MpiFlavor flavor_ = MpiFlavor::kOpenMpi;
  int thread_level_ = 0;
  bool initialised_here_ = false;
  ProcessOrigin origin_;  // a forked child exits without finalising its parent's MPI
  bool finalised_ = false;
  int groups_ = 0;
  std::mutex serial_;
  MpiApi<void*> open_mpi_;
  MpiApi<int> mpich_;

  int (*initialized_)(int*) = nullptr;
  int (*finalized_)(int*) = nullptr;
  int (*init_thread_)(int*, char***, int, int*) = nullptr;
  int (*query_thread_)(int*) = nullptr;
  int (*finalize_)() = nullptr;
  int (*error_string_)(int, char*, int*) = nullptr;
};

}  // namespace dparallel::dist
