#include "distributed/mpi/mpi_library.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/device.h"

namespace dparallel::dist {

namespace {

// The thread levels, the same in Open MPI and MPICH (and the MPI standard's order).
constexpr int kThreadSerialized = 2;
constexpr int kThreadMultiple = 3;
constexpr int kMaxVersionBytes = 8192;  // MPI_MAX_LIBRARY_VERSION_STRING in both (Open MPI's is smaller)

// MPICH's fixed handle values (mpi.h of MPICH 3 and 4, the ABI Intel MPI shares).
constexpr int kMpichCommWorld = 0x44000000;
constexpr int kMpichCommNull = 0x04000000;
constexpr int kMpichRequestNull = 0x2c000000;
constexpr int kMpichErrorsReturn = 0x54000001;
constexpr int kMpichByte = 0x4c00010d;
constexpr int kMpichFloat = 0x4c00040a;
constexpr int kMpichDouble = 0x4c00080b;
constexpr int kMpichInt8 = 0x4c000137;
constexpr int kMpichUInt8 = 0x4c00013b;
constexpr int kMpichInt16 = 0x4c000238;
constexpr int kMpichInt32 = 0x4c000439;
constexpr int kMpichInt64 = 0x4c00083a;
constexpr int kMpichMax = 0x58000001;
constexpr int kMpichMin = 0x58000002;
constexpr int kMpichSum = 0x58000003;
constexpr int kMpichProd = 0x58000004;
// MPI_IN_PLACE: (void*)-1 in MPICH, (void*)1 in Open MPI: sentinels, never dereferenced.
void* const kMpichInPlace = reinterpret_cast<void*>(static_cast<intptr_t>(-1));   // NOLINT(performance-no-int-to-ptr)
void* const kOpenMpiInPlace = reinterpret_cast<void*>(static_cast<intptr_t>(1));  // NOLINT(performance-no-int-to-ptr)

std::mutex& load_mutex() {
  static std::mutex mutex;
  return mutex;
}

// Set once the library loaded and initialised; the error of a failed load is kept.
MpiLibrary* g_library = nullptr;
std::optional<Error>& load_error() {
  static std::optional<Error> error;
  return error;
}

bool env_set(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0';
}

// The libraries to try, in order: DP_MPI_LIBRARY alone when set; else the
// launcher's implementation first (a rank under MPICH's mpiexec that loaded
// Open MPI would start a world of its own).
std::vector<std::string> candidates() {
  const char* asked = std::getenv("DP_MPI_LIBRARY");
  if (asked != nullptr && *asked != '\0') return {asked};
  const std::vector<std::string> open_mpi = {"libmpi.so.40"};
  const std::vector<std::string> mpich = {"libmpi.so.12", "libmpich.so.12"};
  bool mpich_launched = env_set("PMI_RANK") || env_set("PMI_SIZE") || env_set("HYDRA_CONTROL_FD");
  std::vector<std::string> order = mpich_launched ? mpich : open_mpi;
  for (const std::string& name : mpich_launched ? open_mpi : mpich) order.push_back(name);
  return order;
}

std::string thread_level_name(int level) {
  switch (level) {
    case 0:
      return "MPI_THREAD_SINGLE";
    case 1:
      return "MPI_THREAD_FUNNELED";
    case kThreadSerialized:
      return "MPI_THREAD_SERIALIZED";
    case kThreadMultiple:
      return "MPI_THREAD_MULTIPLE";
    default:
      return str_cat("thread level ", level);
  }
}

void finalize_at_exit() { MpiLibrary::finalize_if_ours(); }

}  // namespace

MpiLibrary& MpiLibrary::get() {
  std::lock_guard<std::mutex> lock(load_mutex());
  if (g_library != nullptr) {
    if (g_library->finalised_) {
      fail(StatusCode::kUnsupported,
           "DP_BACKEND_MPI: MPI was finalised (dp_shutdown) and cannot start again in this process");
    }
    return *g_library;
  }
  if (load_error()) throw Error(*load_error());
  auto* library = new MpiLibrary();  // lives until exit: MPI cannot be unloaded and loaded again
  try {
    library->load();
    library->initialise();
  } catch (const Error& e) {
    load_error() = e;
    if (library->dl_ == nullptr) delete library;  // else kept: the mapped library stays as it is
    throw;
  }
  g_library = library;
  return *library;
}

bool MpiLibrary::loaded() {
  std::lock_guard<std::mutex> lock(load_mutex());
  return g_library != nullptr;
}

void MpiLibrary::finalize_if_ours() noexcept {
  std::lock_guard<std::mutex> lock(load_mutex());
  MpiLibrary* library = g_library;
  if (library == nullptr || !library->initialised_here_ || library->finalised_ || library->groups_ > 0 ||
      !library->origin_.is_current()) {
    return;
  }
  int finalized = 0;
  if (library->finalized_(&finalized) == 0 && finalized == 0) library->finalize_();
  library->finalised_ = true;
}

void* MpiLibrary::symbol(const char* name) const {
  void* address = ::dlsym(dl_, name);
  if (address == nullptr) fail(StatusCode::kUnsupported, "DP_BACKEND_MPI: ", path_, " has no symbol ", name);
  return address;
}

template <typename Handle>
void MpiLibrary::bind_functions(MpiApi<Handle>& api) const {
  auto bind = [&](auto& function, const char* name) {
    function = reinterpret_cast<std::remove_reference_t<decltype(function)>>(symbol(name));
  };
  bind(api.comm_rank, "MPI_Comm_rank");
  bind(api.comm_size, "MPI_Comm_size");
  bind(api.comm_group, "MPI_Comm_group");
  bind(api.group_incl, "MPI_Group_incl");
  bind(api.group_free, "MPI_Group_free");
  bind(api.comm_create_group, "MPI_Comm_create_group");
  bind(api.comm_free, "MPI_Comm_free");
  bind(api.comm_set_errhandler, "MPI_Comm_set_errhandler");
  bind(api.test, "MPI_Test");
  bind(api.iallreduce, "MPI_Iallreduce");
  bind(api.ibcast, "MPI_Ibcast");
  bind(api.iallgather, "MPI_Iallgather");
  bind(api.ireduce_scatter_block, "MPI_Ireduce_scatter_block");
  bind(api.op_create, "MPI_Op_create");
}

void MpiLibrary::load() {
  std::string tried;
  for (const std::string& name : candidates()) {
    ::dlerror();
    // Global: Open MPI's components, loaded by MPI_Init, resolve symbols of libmpi.
    dl_ = ::dlopen(name.c_str(), RTLD_NOW | RTLD_GLOBAL);
    if (dl_ != nullptr) {
      path_ = name;
      break;
    }
    const char* why = ::dlerror();
    tried += str_cat(tried.empty() ? "" : "; ", name, ": ", why != nullptr ? why : "not found");
  }
  if (dl_ == nullptr) {
    fail(StatusCode::kUnsupported, "DP_BACKEND_MPI: no MPI library could be loaded (", tried,
         "); install Open MPI (libmpi.so.40) or MPICH (libmpich.so.12), or name the library in DP_MPI_LIBRARY");
  }
  auto get_version = reinterpret_cast<int (*)(char*, int*)>(symbol("MPI_Get_library_version"));
  std::vector<char> text(kMaxVersionBytes + 1, '\0');
  int length = 0;
  if (get_version(text.data(), &length) == 0) {
    version_.assign(text.data());
    size_t line_end = version_.find('\n');
    if (line_end != std::string::npos) version_.resize(line_end);
  }
  if (::dlsym(dl_, "ompi_mpi_comm_world") != nullptr) {
    flavor_ = MpiFlavor::kOpenMpi;
  } else if (version_.find("MPICH") != std::string::npos || version_.find("Intel(R) MPI") != std::string::npos) {
    flavor_ = MpiFlavor::kMpich;
  } else {
    fail(StatusCode::kUnsupported, "DP_BACKEND_MPI: ", path_, " (\"", version_,
         "\") is neither Open MPI nor an MPICH-ABI library (MPICH, Intel MPI); dparallel knows only their ABIs");
  }
  initialized_ = reinterpret_cast<int (*)(int*)>(symbol("MPI_Initialized"));
  finalized_ = reinterpret_cast<int (*)(int*)>(symbol("MPI_Finalized"));
  init_thread_ = reinterpret_cast<int (*)(int*, char***, int, int*)>(symbol("MPI_Init_thread"));
  query_thread_ = reinterpret_cast<int (*)(int*)>(symbol("MPI_Query_thread"));
  finalize_ = reinterpret_cast<int (*)()>(symbol("MPI_Finalize"));
  error_string_ = reinterpret_cast<int (*)(int, char*, int*)>(symbol("MPI_Error_string"));
  if (flavor_ == MpiFlavor::kOpenMpi) {
    bind_functions(open_mpi_);
    MpiApi<void*>& api = open_mpi_;
    api.comm_world = symbol("ompi_mpi_comm_world");
    api.comm_null = symbol("ompi_mpi_comm_null");
    api.request_null = symbol("ompi_request_null");
    api.errors_return = symbol("ompi_mpi_errors_return");
    api.type_byte = symbol("ompi_mpi_byte");
    api.type_float = symbol("ompi_mpi_float");
    api.type_double = symbol("ompi_mpi_double");
    api.type_int8 = symbol("ompi_mpi_int8_t");
    api.type_uint8 = symbol("ompi_mpi_uint8_t");
    api.type_int16 = symbol("ompi_mpi_int16_t");
    api.type_int32 = symbol("ompi_mpi_int32_t");
    api.type_int64 = symbol("ompi_mpi_int64_t");
    api.op_sum = symbol("ompi_mpi_op_sum");
    api.op_prod = symbol("ompi_mpi_op_prod");
    api.op_min = symbol("ompi_mpi_op_min");
    api.op_max = symbol("ompi_mpi_op_max");
    api.in_place = kOpenMpiInPlace;
  } else {
    bind_functions(mpich_);
    MpiApi<int>& api = mpich_;
    api.comm_world = kMpichCommWorld;
    api.comm_null = kMpichCommNull;
    api.request_null = kMpichRequestNull;
    api.errors_return = kMpichErrorsReturn;
    api.type_byte = kMpichByte;
    api.type_float = kMpichFloat;
    api.type_double = kMpichDouble;
    api.type_int8 = kMpichInt8;
    api.type_uint8 = kMpichUInt8;
    api.type_int16 = kMpichInt16;
    api.type_int32 = kMpichInt32;
    api.type_int64 = kMpichInt64;
    api.op_sum = kMpichSum;
    api.op_prod = kMpichProd;
    api.op_min = kMpichMin;
    api.op_max = kMpichMax;
    api.in_place = kMpichInPlace;
  }
}

void MpiLibrary::initialise() {
  int finalized = 0;
  finalized_(&finalized);
  if (finalized != 0) fail(StatusCode::kUnsupported, "DP_BACKEND_MPI: MPI was finalised already in this process");
  int initialized = 0;
  initialized_(&initialized);
  if (initialized != 0) {
    query_thread_(&thread_level_);
    if (thread_level_ < kThreadSerialized) {
      fail(StatusCode::kUnsupported, "DP_BACKEND_MPI: the host initialised MPI at ", thread_level_name(thread_level_),
           "; dparallel calls MPI from a group's own thread and needs MPI_THREAD_MULTIPLE or MPI_THREAD_SERIALIZED "
           "(MPI_Init_thread)");
    }
    return;
  }
  int rc = init_thread_(nullptr, nullptr, kThreadMultiple, &thread_level_);
  if (rc != 0) fail(StatusCode::kUnsupported, "DP_BACKEND_MPI: MPI_Init_thread failed: ", error_string(rc));
  initialised_here_ = true;
  std::atexit(finalize_at_exit);
  if (thread_level_ < kThreadSerialized) {
    fail(StatusCode::kUnsupported, "DP_BACKEND_MPI: ", path_, " offers only ", thread_level_name(thread_level_),
         "; dparallel needs MPI_THREAD_MULTIPLE or MPI_THREAD_SERIALIZED");
  }
}

std::unique_lock<std::mutex> MpiLibrary::serialize() {
  if (thread_level_ >= kThreadMultiple) return {};
  return std::unique_lock<std::mutex>(serial_);
}

std::string MpiLibrary::error_string(int code) const {
  std::vector<char> text(kMaxVersionBytes + 1, '\0');
  int length = 0;
  if (error_string_ != nullptr && error_string_(code, text.data(), &length) == 0) {
    return str_cat(text.data(), " (MPI error ", code, ")");
  }
  return str_cat("MPI error ", code);
}

void MpiLibrary::add_group() {
  std::lock_guard<std::mutex> lock(load_mutex());
  ++groups_;
}

void MpiLibrary::remove_group() {
  std::lock_guard<std::mutex> lock(load_mutex());
  --groups_;
}

std::optional<Error> mpi_availability(const Device& /*device*/) {
  try {
    MpiLibrary::get();
  } catch (const Error& e) {
    return e;
  }
  return std::nullopt;
}

}  // namespace dparallel::dist
