#include "module/state_dict.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <set>

#include "core/error.h"
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

// A file read by offset, closed on scope exit.
class InputFile {
 public:
  explicit InputFile(const std::string& path) : path_(path), fd_(::open(path.c_str(), O_RDONLY | O_CLOEXEC)) {
    if (fd_ < 0) io_error("cannot open", path);
    struct stat info {};
    if (fstat(fd_, &info) != 0) io_error("cannot stat", path);
    if (!S_ISREG(info.st_mode)) fail(StatusCode::kIo, "'", path, "' is not a regular file");
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

// The tensor a state-dict key names, or an undefined tensor when it names none.
Tensor resolve(Module& root, const std::string& key) {
  Module* m = &root;
  size_t start = 0;
  for (size_t dot; (dot = key.find('.', start)) != std::string::npos; start = dot + 1) {
    std::string part = key.substr(start, dot - start);
    Module* next = nullptr;
    for (const auto& c : m->child_slots()) {
      if (c.name == part) next = c.module.get();
    }
    if (next == nullptr) return Tensor();
    m = next;
  }
  std::string leaf = key.substr(start);
  for (const auto& p : m->parameter_slots()) {
    if (p.name == leaf && p.parameter) return p.parameter->value();
  }
  for (const auto& b : m->buffer_slots()) {
    if (b.name == leaf && b.persistent) return b.value;
  }
  return Tensor();
}

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

void save_module(Module& module, const std::string& path) {
  std::vector<StateEntry> entries = state_dict(module);
  std::vector<safetensors::Entry> layout;
  uint64_t offset = 0;
  for (const StateEntry& e : entries) {
    if (e.name == "__metadata__") fail_invalid("a tensor named \"__metadata__\" cannot be saved in safetensors");
    layout.push_back(safetensors::Entry{e.name, e.value.dtype(), e.value.shape(), offset, offset + e.value.nbytes()});
    offset += e.value.nbytes();
  }
  std::string header = safetensors::encode_header(layout, {{"format", "pt"}});
  // A fresh name beside `path` (rename stays within one file system): saves
  // to one path do not collide, and no file of the user's is overwritten.
  std::string temporary = path + ".XXXXXX";
  {
    int fd = ::mkstemp(temporary.data());
    if (fd < 0) io_error("cannot create a temporary file beside", path);
    // mkstemp makes the file 0600; a saved checkpoint gets the usual 0666 & ~umask.
    File f(fchmod(fd, 0666 & ~current_umask()) == 0 ? ::fdopen(fd, "wb") : nullptr);
    if (!f) {
      int saved = errno;
      ::close(fd);
      std::remove(temporary.c_str());
      errno = saved;
      io_error("cannot create", temporary);
    }
    bool ok = std::fwrite(header.data(), 1, header.size(), f.get()) == header.size();
    std::vector<uint8_t> staging;
    for (size_t i = 0; ok && i < entries.size(); ++i) {
      const Tensor& t = entries[i].value;
      const void* bytes = t.data();
      if (!t.device().is_cpu()) {
        staging.resize(t.nbytes());
        copy_bytes(staging.data(), kHost, t.data(), t.device(), t.nbytes());
        bytes = staging.data();
      }
      ok = std::fwrite(bytes, 1, t.nbytes(), f.get()) == t.nbytes();
    }
    if (!ok || std::fflush(f.get()) != 0) {
      int saved = errno;
      f.reset();
      std::remove(temporary.c_str());
      errno = saved;
      io_error("cannot write", temporary);
    }
    if (std::fclose(f.release()) != 0) {
      std::remove(temporary.c_str());
      io_error("cannot write", temporary);
    }
  }
  if (std::rename(temporary.c_str(), path.c_str()) != 0) {
    int saved = errno;
    std::remove(temporary.c_str());
    errno = saved;
    io_error("cannot rename the saved file to", path);
  }
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
  for (const safetensors::Entry& e : header.entries) {
    Tensor target = resolve(module, e.name);
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

void load_module(Module& module, const std::string& path, bool strict) {
  // Header first, then each tensor's bytes straight into place: loading never
  // holds a second copy of the file, and a hostile header length costs nothing.
  InputFile file(path);
  uint8_t first_bytes[8] = {};
  file.read_at(first_bytes, std::min<uint64_t>(8, file.size()), 0);
  const uint64_t header_bytes = parse_from(path, [&] { return safetensors::header_length(first_bytes, file.size()); });
  std::string text(static_cast<size_t>(header_bytes), '\0');
  file.read_at(text.data(), header_bytes, 8);
  const safetensors::Header header =
      parse_from(path, [&] { return safetensors::parse_header(text.data(), header_bytes, file.size()); });
  std::vector<uint8_t> staging;
  for (const auto& [entry, target] : plan_load(module, header, path, strict)) {
    const uint64_t offset = header.data_offset + entry->begin;
    if (target.device().is_cpu()) {
      file.read_at(target.data(), target.nbytes(), offset);
    } else {
      staging.resize(target.nbytes());
      file.read_at(staging.data(), target.nbytes(), offset);
      copy_bytes(target.data(), target.device(), staging.data(), kHost, target.nbytes());
    }
  }
}

void load_module_image(Module& module, const uint8_t* data, size_t size, const std::string& origin, bool strict) {
  const safetensors::Header header = parse_from(origin, [&] { return safetensors::parse(data, size); });
  for (const auto& [entry, target] : plan_load(module, header, origin, strict)) {
    copy_bytes(target.data(), target.device(), data + header.data_offset + entry->begin, kHost, target.nbytes());
  }
}

}  // namespace dparallel
