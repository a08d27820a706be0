#include "module/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace dparallel::safetensors {

namespace {

using Json = nlohmann::ordered_json;

// A header is one object of objects of arrays: anything deeper is hostile.
constexpr int kMaxJsonDepth = 3;
constexpr int32_t kMaxDims = 16;

struct DTypeCode {
  DType dtype;
  const char* code;
};
constexpr DTypeCode kCodes[] = {
    {DType::kFloat32, "F32"},   {DType::kFloat64, "F64"}, {DType::kFloat16, "F16"},
    {DType::kBFloat16, "BF16"}, {DType::kInt8, "I8"},     {DType::kUInt8, "U8"},
    {DType::kInt32, "I32"},     {DType::kInt64, "I64"},   {DType::kBool, "BOOL"},
};

template <typename... Args>
[[noreturn]] void malformed(Args&&... args) {
  fail(StatusCode::kIo, "malformed safetensors data: ", std::forward<Args>(args)...);
}

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

DType dtype_from_code(const std::string& code, const std::string& name) {
  for (const DTypeCode& c : kCodes) {
    if (code == c.code) return c.dtype;
  }
  malformed("tensor \"", name, "\" has dtype \"", code,
            "\", which is not one of F32, F64, F16, BF16, I8, U8, I32, I64, BOOL");
}

uint64_t unsigned_field(const Json& value, const std::string& name, const char* field) {
  if (!value.is_number_unsigned()) malformed("tensor \"", name, "\": ", field, " must hold non-negative integers");
  return value.get<uint64_t>();
}

Entry parse_entry(const std::string& name, const Json& info, uint64_t data_size) {
  if (!info.is_object()) malformed("the value of \"", name, "\" is not an object");
  auto dtype = info.find("dtype");
  auto shape = info.find("shape");
  auto offsets = info.find("data_offsets");
  if (dtype == info.end() || !dtype->is_string()) malformed("tensor \"", name, "\" has no \"dtype\" string");
  if (shape == info.end() || !shape->is_array()) malformed("tensor \"", name, "\" has no \"shape\" array");
  if (offsets == info.end() || !offsets->is_array() || offsets->size() != 2) {
    malformed("tensor \"", name, "\" has no \"data_offsets\" pair");
  }
  Entry e;
  e.name = name;
  e.dtype = dtype_from_code(dtype->get<std::string>(), name);
  if (shape->size() > static_cast<size_t>(kMaxDims)) {
    malformed("tensor \"", name, "\" has ", shape->size(), " dimensions; at most ", kMaxDims, " are supported");
  }
  uint64_t numel = 1;
  bool empty = false;
  for (const Json& extent : *shape) {
    uint64_t n = unsigned_field(extent, name, "shape");
    if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      malformed("tensor \"", name, "\" has an extent of ", n);
    e.shape.push_back(static_cast<int64_t>(n));
    if (n == 0) empty = true;
    if (!empty && numel > std::numeric_limits<uint64_t>::max() / n) {
      malformed("tensor \"", name, "\" has more elements than fit in 64 bits");
    }
    if (!empty) numel *= n;
  }
  if (empty) numel = 0;
  uint64_t element = dtype_size(e.dtype);
  if (numel > std::numeric_limits<uint64_t>::max() / element) malformed("tensor \"", name, "\" is too large");
  e.begin = unsigned_field((*offsets)[0], name, "data_offsets");
  e.end = unsigned_field((*offsets)[1], name, "data_offsets");
  if (e.begin > e.end || e.end > data_size) {
    malformed("tensor \"", name, "\" has data_offsets [", e.begin, ", ", e.end, "] outside the ", data_size,
              "-byte data section");
  }
  if (e.end - e.begin != numel * element) {
    malformed("tensor \"", name, "\" has data_offsets [", e.begin, ", ", e.end, "] (", e.end - e.begin,
              " bytes) but its dtype and shape need ", numel * element, " bytes");
  }
  return e;
}

// Stops at the first bracket nested deeper than kMaxJsonDepth, before the
// JSON parser would build (and keep on a stack) every level of a hostile header.
void check_depth(const char* text, uint64_t n) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (uint64_t i = 0; i < n; ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped)
        escaped = false;
      else if (c == '\\')
        escaped = true;
      else if (c == '"')
        in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxJsonDepth) malformed("the header nests deeper than ", kMaxJsonDepth, " levels");
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
}

}  // namespace

const char* dtype_code(DType dtype) {
  for (const DTypeCode& c : kCodes) {
    if (c.dtype == dtype) return c.code;
  }
  fail(StatusCode::kInternal, "no safetensors code for dtype ", static_cast<int>(dtype));
}

uint64_t header_length(const uint8_t* first_bytes, uint64_t size) {
  if (size < 8) malformed("the data is ", size, " bytes, shorter than the 8-byte header length");
  uint64_t header_bytes = read_u64_le(first_bytes);
  if (header_bytes > kMaxHeaderBytes) {
    malformed("the header length is ", header_bytes, " bytes, more than the ", kMaxHeaderBytes, " allowed");
  }
  if (header_bytes > size - 8) {
    malformed("the header length is ", header_bytes, " bytes but only ", size - 8, " bytes follow it");
  }
  return header_bytes;
}

Header parse(const uint8_t* data, size_t size) {
  const uint64_t header_bytes = header_length(data, size);
  return parse_header(reinterpret_cast<const char*>(data + 8), header_bytes, size);
}

Header parse_header(const char* text, uint64_t header_bytes, uint64_t size) {
  if (header_bytes == 0 || text[0] != '{') malformed("the header does not start with '{'");
  check_depth(text, header_bytes);
  Json header = Json::parse(text, text + header_bytes, nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) malformed("the header is not a JSON object");

  Header out;
  out.data_offset = 8 + header_bytes;
  const uint64_t data_size = size - out.data_offset;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object()) malformed("\"__metadata__\" is not an object");
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        if (!m.value().is_string()) malformed("\"__metadata__\" value of \"", m.key(), "\" is not a string");
        out.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    out.entries.push_back(parse_entry(it.key(), it.value(), data_size));
  }
  // The tensors must tile the data section: no overlap, no hole, nothing after.
  std::vector<const Entry*> by_offset;
  for (const Entry& e : out.entries) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(), [](const Entry* a, const Entry* b) {
    return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
  });
  uint64_t expected = 0;
  for (const Entry* e : by_offset) {
    if (e->begin != expected) {
      malformed("tensor \"", e->name, "\" starts at data offset ", e->begin, " but the previous tensor ends at ",
                expected, " (tensors must not overlap or leave gaps)");
    }
    expected = e->end;
  }
  if (expected != data_size) {
    malformed("the tensors cover ", expected, " bytes of data but the data section holds ", data_size, " bytes");
  }
  return out;
}

std::string encode_header(const std::vector<Entry>& entries, const std::map<std::string, std::string>& metadata) {
  Json header = Json::object();
  if (!metadata.empty()) {
    Json meta = Json::object();
    for (const auto& [key, value] : metadata) meta[key] = value;
    header["__metadata__"] = std::move(meta);
  }
  for (const Entry& e : entries) {
    header[e.name] = Json{{"dtype", dtype_code(e.dtype)}, {"shape", e.shape}, {"data_offsets", {e.begin, e.end}}};
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text;
}

}  // namespace dparallel::safetensors
