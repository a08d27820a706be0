#include "ddp/plan_text.h"

#include <sstream>
#include <unordered_map>

#include "core/error.h"

namespace dparallel::ddp {

namespace {

constexpr const char* kHeader = "# dparallel DDP bucket plan 1: one bucket per line, in launch order";

bool needs_escape(unsigned char c) { return c <= 0x20 || c == 0x7f || c == '%'; }

std::string encode(const std::string& name) {
  static const char* kHex = "0123456789ABCDEF";
  std::string out;
  for (unsigned char c : name) {
    if (needs_escape(c)) {
      out += '%';
      out += kHex[c >> 4];
      out += kHex[c & 15];
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

std::string decode(const std::string& word, const char* argument, size_t line) {
  std::string out;
  for (size_t i = 0; i < word.size(); ++i) {
    if (word[i] != '%') {
      out += word[i];
      continue;
    }
    int hi = i + 2 < word.size() ? hex_value(word[i + 1]) : -1;
    int lo = i + 2 < word.size() ? hex_value(word[i + 2]) : -1;
    if (hi < 0 || lo < 0) {
      fail_invalid("argument '", argument, "', line ", line, ": '", word, "' has a '%' not followed by two hex digits");
    }
    out += static_cast<char>(hi * 16 + lo);
    i += 2;
  }
  return out;
}

}  // namespace

std::string format_plan(const std::vector<PlanParam>& params, const std::vector<std::vector<size_t>>& buckets) {
  std::string text = kHeader;
  text += '\n';
  for (const auto& bucket : buckets) {
    text += "bucket ";
    text += bucket.empty() ? "float32" : dtype_name(params.at(bucket.front()).dtype);
    for (size_t p : bucket) {
      text += ' ';
      text += encode(params.at(p).name);
    }
    text += '\n';
  }
  return text;
}

std::vector<std::vector<size_t>> parse_plan(const std::string& text, const std::vector<PlanParam>& params,
                                            const char* argument) {
  std::unordered_map<std::string, size_t> index_of;
  for (size_t i = 0; i < params.size(); ++i) index_of.emplace(params[i].name, i);
  std::vector<int64_t> bucket_of(params.size(), -1);
  std::vector<std::vector<size_t>> buckets;
  std::istringstream in(text);
  size_t line_number = 0;
  for (std::string line; std::getline(in, line);) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#') continue;
    std::istringstream words(line);
    std::string keyword, dtype_text;
    words >> keyword >> dtype_text;
    if (keyword != "bucket" || dtype_text.empty()) {
      fail_invalid("argument '", argument, "', line ", line_number, ": expected 'bucket <dtype> <names...>', got '",
                   line.substr(0, 80), "'");
    }
    DType dtype = DType::kFloat32;
    bool known_dtype = false;
    for (int32_t code = 0; code <= static_cast<int32_t>(DType::kBool); ++code) {
      if (dtype_text == dtype_name(static_cast<DType>(code))) {
        dtype = static_cast<DType>(code);
        known_dtype = true;
      }
    }
    if (!known_dtype)
      fail_invalid("argument '", argument, "', line ", line_number, ": unknown dtype '", dtype_text, "'");
    std::vector<size_t> bucket;
    for (std::string word; words >> word;) {
      std::string name = decode(word, argument, line_number);
      auto it = index_of.find(name);
      if (it == index_of.end()) {
        fail_invalid("argument '", argument, "', line ", line_number, ": '", name,
                     "' is not a parameter this dp_ddp manages");
      }
      size_t p = it->second;
      if (bucket_of[p] >= 0) {
        fail_invalid("argument '", argument, "', line ", line_number, ": '", name, "' is already in bucket ",
                     bucket_of[p]);
      }
      if (params[p].dtype != dtype) {
        fail_invalid("argument '", argument, "', line ", line_number, ": '", name, "' is ", dtype_name(params[p].dtype),
                     " but its bucket is ", dtype_text);
      }
      bucket_of[p] = static_cast<int64_t>(buckets.size());
      bucket.push_back(p);
    }
    if (bucket.empty()) fail_invalid("argument '", argument, "', line ", line_number, ": a bucket with no parameter");
    buckets.push_back(std::move(bucket));
  }
  std::vector<std::string> missing;
  for (size_t p = 0; p < params.size(); ++p) {
    if (bucket_of[p] < 0) missing.push_back("'" + params[p].name + "'");
  }
  if (!missing.empty()) {
    std::string names;
    for (size_t i = 0; i < missing.size() && i < 8; ++i) names += (i == 0 ? "" : ", ") + missing[i];
    if (missing.size() > 8) names += str_cat(" and ", missing.size() - 8, " more");
    fail_invalid("argument '", argument, "' leaves out ", missing.size(), " managed parameter(s): ", names);
  }
  return buckets;
}

}  // namespace dparallel::ddp
