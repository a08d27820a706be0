#include "module/state_dict.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string_view>
#include <unordered_map>

#include "core/error.h"
#include "module/checksum.h"
#include "module/safetensors.h"

namespace dparallel {

namespace {

const Device kHost{DeviceType::kCpu, 0};

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

[[noreturn]] void io_error(const char* what, const std::string& path) {
  fail(StatusCode::kIo, what, " '", path, "': ", std::strerror(errno));
}

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

[[noreturn]] void not_regular(const std::string& path, mode_t mode) {
  fail_invalid("argument 'path' ('", path, "') is ", file_kind(mode), "; checkpoints are regular files");
}

// A file read by offset, closed on scope exit.
class InputFile {
 public:
  // O_NONBLOCK: opening a FIFO must not wait for a writer before its type is
  // known. It changes nothing for the regular files read after the check.
  explicit InputFile(const std::string& path)
      : path_(path), fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK)) {
    if (fd_ < 0) io_error("cannot open", path);
    struct stat info {};
    if (fstat(fd_, &info) != 0) {
      int saved = errno;
      ::close(fd_);
      errno = saved;
      io_error("cannot stat", path);
    }
    if (!S_ISREG(info.st_mode)) {
      ::close(fd_);
      not_regular(path, info.st_mode);
    }
    size_ = static_cast<uint64_t>(info.st_size);
  }
  ~InputFile() { ::close(fd_); }
  InputFile(const InputFile&) = delete;
  InputFile& operator=(const InputFile&) = delete;

  uint64_t size() const { return size_; }
  void read_at(void* dst, uint64_t nbytes, uint64_t offset) const {
    auto* out = static_cast<uint8_t*>(dst);
    while (nbytes > 0) {
      ssize_t got = ::pread(fd_, out, nbytes, static_cast<off_t>(offset));
      if (got < 0 && errno == EINTR) continue;
      if (got < 0) io_error("cannot read", path_);
      if (got == 0) fail(StatusCode::kIo, "cannot read '", path_, "': it ended early (was it changed while loading?)");
      out += got;
      offset += static_cast<uint64_t>(got);
      nbytes -= static_cast<uint64_t>(got);
    }
  }

 private:
  std::string path_;
  int fd_;
  uint64_t size_ = 0;
};

// Where a save to `path` lands: `path`, or for a symbolic link the file it
// finally names (which may not exist yet), so that the link is kept.
std::string save_target(const std::string& path) {
  constexpr int kMaxLinks = 40;  // as the kernel's ELOOP limit
  std::string target = path;
  for (int links = 0;; ++links) {
    struct stat info {};
    if (::lstat(target.c_str(), &info) != 0) {
      if (errno == ENOENT) return target;  // a new file, made where the path (or link) points
      io_error("cannot stat", target);
    }
    if (!S_ISLNK(info.st_mode)) return target;
    if (links == kMaxLinks)
      fail(StatusCode::kIo, "cannot save to '", path, "': more than ", kMaxLinks, " symbolic links");
    std::vector<char> buffer(static_cast<size_t>(info.st_size > 0 ? info.st_size : PATH_MAX) + 1);
    ssize_t n = ::readlink(target.c_str(), buffer.data(), buffer.size());
    if (n < 0) io_error("cannot read the symbolic link", target);
    if (static_cast<size_t>(n) >= buffer.size()) fail(StatusCode::kIo, "the symbolic link '", target, "' changed");
    std::string link(buffer.data(), static_cast<size_t>(n));
    const size_t slash = target.rfind('/');
    if (link.empty() || link[0] == '/' || slash == std::string::npos) {
      target = link;
    } else {
      target.resize(slash + 1);  // a relative link is relative to its own folder
      target += link;
    }
  }
}

// The folder part of `path` with its trailing '/', or "" for a bare name.
std::string folder_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
}

// The process's umask, read without changing it (umask() would, for every thread).
mode_t current_umask() {
  File f(std::fopen("/proc/self/status", "r"));
  char line[256];
  while (f && std::fgets(line, sizeof line, f.get()) != nullptr) {
    unsigned mask = 0;
    if (std::sscanf(line, "Umask: %o", &mask) == 1) return static_cast<mode_t>(mask);
  }
  return 022;
}

// Finds the tensor a state-dict key names, through per-module name indexes
// built on first use: one lookup per key component, however wide a module.
class KeyResolver {
 public:
  explicit KeyResolver(Module& root) : root_(root) {}

  // The tensor `key` names, or an undefined tensor when it names none.
  Tensor resolve(const std::string& key) {
    const Module* m = &root_;
    size_t start = 0;
    for (size_t dot; (dot = key.find('.', start)) != std::string::npos; start = dot + 1) {
      const Index& index = index_of(*m);
      auto child = index.children.find(std::string_view(key).substr(start, dot - start));
      if (child == index.children.end()) return Tensor();
      m = child->second;
    }
    const Index& index = index_of(*m);
    auto tensor = index.tensors.find(std::string_view(key).substr(start));
    return tensor == index.tensors.end() ? Tensor() : tensor->second;
  }

 private:
  struct Index {
    std::unordered_map<std::string_view, const Module*> children;  // views of the modules' own names
    std::unordered_map<std::string_view, Tensor> tensors;          // parameters and persistent buffers
  };

  const Index& index_of(const Module& m) {
    auto [it, inserted] = indexes_.try_emplace(&m);
    if (!inserted) return it->second;
    Index& index = it->second;
    for (const auto& c : m.child_slots()) {
      if (c.module) index.children.emplace(c.name, c.module.get());
    }
    for (const auto& p : m.parameter_slots()) {
      if (p.parameter) index.tensors.emplace(p.name, p.parameter->value());
    }
    for (const auto& b : m.buffer_slots()) {
      if (b.persistent && b.value.defined()) index.tensors.emplace(b.name, b.value);
    }
    return index;
  }

  Module& root_;
  std::unordered_map<const Module*, Index> indexes_;
};

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "\"" : ", \"") + n + "\"";
  return out;
}

}  // namespace

std::vector<StateEntry> state_dict(Module& module) {
  std::vector<StateEntry> out;
  std::set<TensorIdentity> seen;
  for (const NamedModule& nm : module.named_modules()) {
    std::string prefix = nm.name.empty() ? "" : nm.name + ".";
    for (const auto& p : nm.module->parameter_slots()) {
      if (p.parameter && seen.insert(identity_of(p.parameter->value())).second) {
        out.push_back(StateEntry{prefix + p.name, p.parameter->value()});
      }
    }
    for (const auto& b : nm.module->buffer_slots()) {
      if (b.persistent && b.value.defined() && seen.insert(identity_of(b.value)).second) {
        out.push_back(StateEntry{prefix + b.name, b.value});
      }
    }
  }
  return out;
}

void save_module(Module& module, const std::string& path) { save_state(state_dict(module), {{"format", "pt"}}, path); }

namespace {

// Makes a rename in `folder` (of `target`) last through a crash; best
// effort, as some file systems cannot sync a folder.
void sync_folder_of(const std::string& target) {
  const std::string folder = folder_of(target);
  int fd = ::open(folder.empty() ? "." : folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  (void)::fsync(fd);
  ::close(fd);
}

}  // namespace

void write_atomically(const std::string& path, const std::function<bool(std::FILE*)>& write) {
  const std::string target = save_target(path);
  const std::string named = target == path ? "'" + path + "'" : "'" + target + "' (the target of '" + path + "')";
  mode_t mode = 0666 & ~current_umask();  // what a new file gets
  struct stat existing {};
  if (::stat(target.c_str(), &existing) == 0) {
    if (!S_ISREG(existing.st_mode)) not_regular(path, existing.st_mode);
    // Replacing by rename needs only the folder's permission: ask the file's.
    if ((existing.st_mode & 0222) == 0) {
      errno = EACCES;
      fail(StatusCode::kIo, "refusing to replace the read-only file ", named, ": ", std::strerror(errno));
    }
    if (::faccessat(AT_FDCWD, target.c_str(), W_OK, AT_EACCESS) != 0) {
      fail(StatusCode::kIo, "refusing to replace ", named, ", which this user cannot write: ", std::strerror(errno));
    }
    mode = existing.st_mode & 07777;  // a replaced file keeps its permissions
  }
  // A fresh short name beside the target (rename stays within one file
  // system; a name built from the target's could pass NAME_MAX): saves to one
  // path do not collide, and no file of the user's is overwritten.
  std::string temporary = folder_of(target) + ".dp-save-XXXXXX";
  {
    int fd = ::mkstemp(temporary.data());
    if (fd < 0) io_error("cannot create a temporary file beside", target);
    // mkstemp makes the file 0600.
    File f(fchmod(fd, mode) == 0 ? ::fdopen(fd, "wb") : nullptr);
    if (!f) {
      int saved_errno = errno;
      ::close(fd);
      std::remove(temporary.c_str());
      errno = saved_errno;
      io_error("cannot create", temporary);
    }
    bool ok = false;
    try {
      ok = write(f.get());
    } catch (...) {
      f.reset();
      std::remove(temporary.c_str());
      throw;
    }
    // On disk before the rename: a crash never leaves the name on a part.
    if (!ok || std::fflush(f.get()) != 0 || ::fsync(fileno(f.get())) != 0) {
      int saved_errno = errno;
      f.reset();
      std::remove(temporary.c_str());
      errno = saved_errno;
      io_error("cannot write", temporary);
    }
    if (std::fclose(f.release()) != 0) {
      std::remove(temporary.c_str());
      io_error("cannot write", temporary);
    }
  }
  if (std::rename(temporary.c_str(), target.c_str()) != 0) {
    int saved_errno = errno;
    std::remove(temporary.c_str());
    errno = saved_errno;
    io_error("cannot rename the saved file to", target);
  }
  sync_folder_of(target);
}

SavedFile save_state(const std::vector<StateEntry>& entries, const std::map<std::string, std::string>& metadata,
                     const std::string& path) {
  std::vector<safetensors::Entry> layout;
  uint64_t offset = 0;
  for (const StateEntry& e : entries) {
    if (e.name == "__metadata__") fail_invalid("a tensor named \"__metadata__\" cannot be saved in safetensors");
    layout.push_back(safetensors::Entry{e.name, e.value.dtype(), e.value.shape(), offset, offset + e.value.nbytes()});
    offset += e.value.nbytes();
  }
  // The checksum is known once the data is written: a stand-in of the same
  // length holds its place, and the header is written again at the end.
  std::map<std::string, std::string> with_checksum = metadata;
  with_checksum[kDataChecksumKey] = crc32c_text(0);
  std::string header = safetensors::encode_header(layout, with_checksum);
  SavedFile saved;
  write_atomically(path, [&](std::FILE* f) {
    saved.entry_crcs.clear();
    if (std::fwrite(header.data(), 1, header.size(), f) != header.size()) return false;
    uint32_t data_crc = 0;
    std::vector<uint8_t> staging;
    for (const StateEntry& e : entries) {
      const Tensor& t = e.value;
      if (t.nbytes() == 0) {  // an empty tensor may have no memory at all
        saved.entry_crcs.push_back(crc32c(0, nullptr, 0));
        continue;
      }
      const void* bytes = t.data();
      if (!t.device().is_cpu()) {
        staging.resize(t.nbytes());
        copy_bytes(staging.data(), kHost, t.data(), t.device(), t.nbytes());
        bytes = staging.data();
      }
      saved.entry_crcs.push_back(crc32c(0, bytes, t.nbytes()));
      data_crc = crc32c(data_crc, bytes, t.nbytes());
      if (std::fwrite(bytes, 1, t.nbytes(), f) != t.nbytes()) return false;
    }
    with_checksum[kDataChecksumKey] = crc32c_text(data_crc);
    header = safetensors::encode_header(layout, with_checksum);
    return std::fflush(f) == 0 &&
           ::pwrite(fileno(f), header.data(), header.size(), 0) == static_cast<ssize_t>(header.size());
  });
  saved.header_crc = crc32c(0, header.data(), header.size());
  saved.bytes = header.size() + offset;
  return saved;
}

namespace {

using Copies = std::vector<std::pair<const safetensors::Entry*, Tensor>>;

template <typename Parse>
auto parse_from(const std::string& origin, Parse&& parse) -> decltype(parse()) {
  try {
    return parse();
  } catch (const Error& e) {
    fail(e.code(), "'", origin, "': ", e.what());
  }
}

// Matches the header's entries to the module's tensors; throws before any
// tensor changes.
Copies plan_load(Module& module, const safetensors::Header& header, const std::string& origin, bool strict) {
  std::vector<StateEntry> expected = state_dict(module);
  std::map<TensorIdentity, size_t> index_of;
  for (size_t i = 0; i < expected.size(); ++i) index_of[identity_of(expected[i].value)] = i;
  std::vector<bool> covered(expected.size(), false);
  std::vector<std::string> unexpected, mismatches;
  Copies copies;
  KeyResolver resolver(module);
  for (const safetensors::Entry& e : header.entries) {
    Tensor target = resolver.resolve(e.name);
    auto found = target.defined() ? index_of.find(identity_of(target)) : index_of.end();
    if (found == index_of.end()) {
      unexpected.push_back(e.name);
      continue;
    }
    if (target.shape() != e.shape || target.dtype() != e.dtype) {
      mismatches.push_back(str_cat("size mismatch for \"", e.name, "\": the file has ", dtype_name(e.dtype), " ",
                                   shape_string(e.shape), ", the module has ", dtype_name(target.dtype()), " ",
                                   shape_string(target.shape())));
      continue;
    }
    covered[found->second] = true;
    copies.emplace_back(&e, target);
  }
  std::vector<std::string> missing;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (!covered[i]) missing.push_back(expected[i].name);
  }
  std::string problems;
  if (strict && !missing.empty()) problems += "missing keys: " + join(missing) + "; ";
  if (strict && !unexpected.empty()) problems += "unexpected keys: " + join(unexpected) + "; ";
  for (const std::string& m : mismatches) problems += m + "; ";
  if (!problems.empty()) {
    problems.resize(problems.size() - 2);
    fail_invalid("error loading '", origin, "' into the module: ", problems);
  }
  return copies;
}

}  // namespace

struct StateFileReader::Impl {
  explicit Impl(const std::string& path) : file(path) {}
  InputFile file;
};

StateFileReader::StateFileReader(const std::string& path) : path_(path), impl_(std::make_unique<Impl>(path)) {
  // A hostile header length costs nothing: it is checked against the
  // file's size before the header is read.
  const InputFile& file = impl_->file;
  uint8_t first_bytes[8] = {};
  file.read_at(first_bytes, std::min<uint64_t>(8, file.size()), 0);
  const uint64_t header_bytes = parse_from(path, [&] { return safetensors::header_length(first_bytes, file.size()); });
  std::string text(static_cast<size_t>(header_bytes), '\0');
  file.read_at(text.data(), header_bytes, 8);
  header_ = parse_from(path, [&] { return safetensors::parse_header(text.data(), header_bytes, file.size()); });
}

StateFileReader::~StateFileReader() = default;

void StateFileReader::read_into(const Tensor& target, size_t target_offset, uint64_t offset, size_t nbytes,
                                std::vector<uint8_t>& staging) const {
  if (nbytes == 0) return;  // an empty tensor may have no memory at all
  auto* dst = static_cast<uint8_t*>(target.data()) + target_offset;
  const uint64_t at = header_.data_offset + offset;
  if (target.device().is_cpu()) {
    impl_->file.read_at(dst, nbytes, at);
    return;
  }
  staging.resize(nbytes);
  impl_->file.read_at(staging.data(), nbytes, at);
  copy_bytes(dst, target.device(), staging.data(), kHost, nbytes);
}

namespace {

// Checksums read the file in pieces of this size at most.
constexpr uint64_t kChecksumChunk = 4u << 20;

uint32_t file_crc(const InputFile& file, uint64_t at, uint64_t nbytes, std::vector<uint8_t>& staging) {
  uint32_t crc = 0;
  staging.resize(static_cast<size_t>(std::min(nbytes, kChecksumChunk)));
  while (nbytes > 0) {
    const uint64_t n = std::min(nbytes, kChecksumChunk);
    file.read_at(staging.data(), n, at);
    crc = crc32c(crc, staging.data(), static_cast<size_t>(n));
    at += n;
    nbytes -= n;
  }
  return crc;
}

// The checksum a header's metadata gives its data section; false when it has none.
bool stated_data_crc(const safetensors::Header& header, const std::string& origin, uint32_t* crc) {
  auto stated = header.metadata.find(kDataChecksumKey);
  if (stated == header.metadata.end()) return false;
  if (!parse_crc32c(stated->second, crc)) {
    fail(StatusCode::kIo, "'", origin, "': its checksum \"", stated->second, "\" (metadata \"", kDataChecksumKey,
         "\") is not eight lowercase hex digits");
  }
  return true;
}

[[noreturn]] void checksum_differs(const std::string& origin, uint32_t stated, uint32_t computed) {
  fail(StatusCode::kIo, "'", origin, "' is damaged: its data's CRC-32C is ", crc32c_text(computed),
       " but its header says ", crc32c_text(stated), " (nothing was loaded)");
}

}  // namespace

uint32_t StateFileReader::data_crc(uint64_t offset, uint64_t nbytes, std::vector<uint8_t>& staging) const {
  return file_crc(impl_->file, header_.data_offset + offset, nbytes, staging);
}

uint32_t StateFileReader::header_crc() const {
  std::vector<uint8_t> staging;
  return file_crc(impl_->file, 0, header_.data_offset, staging);
}

uint64_t StateFileReader::file_size() const { return impl_->file.size(); }

void StateFileReader::verify_data_checksum(std::vector<uint8_t>& staging) const {
  uint32_t stated = 0;
  if (!stated_data_crc(header_, path_, &stated)) return;
  const uint32_t computed = data_crc(0, impl_->file.size() - header_.data_offset, staging);
  if (computed != stated) checksum_differs(path_, stated, computed);
}

std::vector<Tensor> load_module(Module& module, const std::string& path, bool strict) {
  // Header first, then each tensor's bytes straight into place: loading never
  // holds a second copy of the file.
  StateFileReader file(path);
  std::vector<uint8_t> staging;
  const Copies copies = plan_load(module, file.header(), path, strict);
  file.verify_data_checksum(staging);
  std::vector<Tensor> written;
  written.reserve(copies.size());
  for (const auto& [entry, target] : copies) {
    file.read_into(target, 0, entry->begin, target.nbytes(), staging);
    written.push_back(target);
  }
  return written;
}

void load_module_image(Module& module, const uint8_t* data, size_t size, const std::string& origin, bool strict) {
  const safetensors::Header header = parse_from(origin, [&] { return safetensors::parse(data, size); });
  const Copies copies = plan_load(module, header, origin, strict);
  uint32_t stated = 0;
  if (stated_data_crc(header, origin, &stated)) {
    const uint32_t computed = crc32c(0, data + header.data_offset, size - header.data_offset);
    if (computed != stated) checksum_differs(origin, stated, computed);
  }
  for (const auto& [entry, target] : copies) {
    copy_bytes(target.data(), target.device(), data + header.data_offset + entry->begin, kHost, target.nbytes());
  }
}

}  // namespace dparallel
