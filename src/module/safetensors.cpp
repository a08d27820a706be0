#include "module/safetensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <unordered_set>

#include "core/error.h"

namespace dparallel::safetensors {

namespace {

using Json = nlohmann::json;

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

namespace {

// Builds the header while the JSON parser reads it: each tensor's object is
// checked and dropped as soon as it ends, so no document of the whole header
// is kept, nothing is looked up by key in a growing object (which made large
// headers quadratic), and a key seen twice at any level is refused.
class HeaderBuilder {
 public:
  HeaderBuilder(Header& out, uint64_t data_size) : out_(out), data_size_(data_size) {}

  bool operator()(int depth, Json::parse_event_t event, Json& parsed) {
    switch (event) {
      case Json::parse_event_t::object_start:
        if (depth == 1) check_value_is_object(true);
        keys_.emplace_back();
        return true;
      case Json::parse_event_t::key:
        note_key(depth, parsed.get_ref<const std::string&>());
        return true;
      case Json::parse_event_t::object_end:
        keys_.pop_back();
        if (depth == 1) {
          take_value(parsed);
          return false;  // dropped from the root object once taken
        }
        return true;
      case Json::parse_event_t::array_start:
        if (depth == 1) check_value_is_object(false);
        return true;
      case Json::parse_event_t::array_end:
        return true;
      case Json::parse_event_t::value:
        if (depth == 1) check_value_is_object(false);
        return true;
    }
    return true;
  }

 private:
  void note_key(int depth, const std::string& key) {
    if (keys_.empty() || keys_.back().insert(key).second) {
      if (depth == 1) current_ = key;
      return;
    }
    if (depth == 1) {
      malformed("the header has the key \"", key, "\" twice (keys must be unique)");
    } else if (depth == 2) {
      malformed("\"", current_, "\" has the key \"", key, "\" twice (keys must be unique)");
    }
    malformed("the header repeats the key \"", key, "\" inside \"", current_, "\" (keys must be unique)");
  }

  void check_value_is_object(bool is_object) const {
    if (is_object) return;
    if (current_ == "__metadata__") malformed("\"__metadata__\" is not an object");
    malformed("the value of \"", current_, "\" is not an object");
  }

  void take_value(const Json& value) {
    if (current_ == "__metadata__") {
      for (auto m = value.begin(); m != value.end(); ++m) {
        if (!m.value().is_string()) malformed("\"__metadata__\" value of \"", m.key(), "\" is not a string");
        out_.metadata[m.key()] = m.value().get<std::string>();
      }
      return;
    }
    out_.entries.push_back(parse_entry(current_, value, data_size_));
  }

  Header& out_;
  const uint64_t data_size_;
  std::vector<std::unordered_set<std::string>> keys_;  // one set per open object
  std::string current_;                                // the last top-level key
};

}  // namespace

Header parse_header(const char* text, uint64_t header_bytes, uint64_t size) {
  if (header_bytes == 0 || text[0] != '{') malformed("the header does not start with '{'");
  check_depth(text, header_bytes);
  Header out;
  out.data_offset = 8 + header_bytes;
  HeaderBuilder builder(out, size - out.data_offset);
  Json root = Json::parse(text, text + header_bytes, std::ref(builder), /*allow_exceptions=*/false);
  if (root.is_discarded() || !root.is_object()) malformed("the header is not a JSON object");
  const uint64_t data_size = size - out.data_offset;
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
  // Written piece by piece (a JSON object built key by key costs a lookup per key).
  auto quoted = [](const std::string& text) { return Json(text).dump(); };
  std::string text = "{";
  if (!metadata.empty()) {
    text += "\"__metadata__\":{";
    for (const auto& [key, value] : metadata) {
      if (text.back() != '{') text += ',';
      text += quoted(key) + ":" + quoted(value);
    }
    text += "}";
  }
  std::unordered_set<std::string> names;
  for (const Entry& e : entries) {
    if (!names.insert(e.name).second) fail(StatusCode::kInternal, "two tensors to save are named \"", e.name, "\"");
    if (text.back() != '{') text += ',';
    text += quoted(e.name) + ":{\"dtype\":\"" + dtype_code(e.dtype) + "\",\"shape\":[";
    for (size_t i = 0; i < e.shape.size(); ++i) text += (i > 0 ? "," : "") + std::to_string(e.shape[i]);
    text += "],\"data_offsets\":[" + std::to_string(e.begin) + "," + std::to_string(e.end) + "]}";
  }
  text += "}";
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  std::string out(8, '\0');
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + text;
}

}  // namespace dparallel::safetensors
