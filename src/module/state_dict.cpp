#include "module/state_dict.h"

#include <sys/stat.h>

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

std::vector<uint8_t> read_file(const std::string& path) {
  File f(std::fopen(path.c_str(), "rb"));
  if (!f) io_error("cannot open", path);
  struct stat info {};
  if (fstat(fileno(f.get()), &info) != 0) io_error("cannot stat", path);
  if (!S_ISREG(info.st_mode)) fail(StatusCode::kIo, "'", path, "' is not a regular file");
  std::vector<uint8_t> bytes(static_cast<size_t>(info.st_size));
  if (!bytes.empty() && std::fread(bytes.data(), 1, bytes.size(), f.get()) != bytes.size()) {
    io_error("cannot read", path);
  }
  return bytes;
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
  std::string temporary = path + ".tmp";
  {
    File f(std::fopen(temporary.c_str(), "wb"));
    if (!f) io_error("cannot create", temporary);
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

void load_module(Module& module, const std::string& path, bool strict) {
  std::vector<uint8_t> file = read_file(path);
  load_module_image(module, file.data(), file.size(), path, strict);
}

void load_module_image(Module& module, const uint8_t* data, size_t size, const std::string& origin, bool strict) {
  safetensors::Header header;
  try {
    header = safetensors::parse(data, size);
  } catch (const Error& e) {
    fail(e.code(), "'", origin, "': ", e.what());
  }

  std::vector<StateEntry> expected = state_dict(module);
  std::map<TensorIdentity, size_t> index_of;
  for (size_t i = 0; i < expected.size(); ++i) index_of[identity_of(expected[i].value)] = i;
  std::vector<bool> covered(expected.size(), false);
  std::vector<std::string> unexpected, mismatches;
  std::vector<std::pair<const safetensors::Entry*, Tensor>> copies;
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
  for (const auto& [entry, target] : copies) {
    copy_bytes(target.data(), target.device(), data + header.data_offset + entry->begin, kHost, target.nbytes());
  }
}

}  // namespace dparallel
