#include "distributed/nodelist.h"

#include <cstdint>
#include <cstdio>

#include "core/error.h"

namespace dparallel::dist {

namespace {

// lo..hi, each written with at least `width` digits.
struct Range {
  uint64_t lo = 0;
  uint64_t hi = 0;
  size_t width = 0;
};

// Literal text, or (with ranges) one of a set of numbers.
struct Piece {
  std::string literal;
  std::vector<Range> ranges;
};

using HostPattern = std::vector<Piece>;

// Up to 18 digits: every number and range size fits in uint64_t.
constexpr size_t kMaxDigits = 18;

bool is_host_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '-' || c == '_';
}

// A character for a message: itself when printable, else its code.
std::string shown_char(char c) {
  char shown[16];
  if (c >= ' ' && c < 127) {
    std::snprintf(shown, sizeof(shown), "'%c'", c);
  } else {
    std::snprintf(shown, sizeof(shown), "byte 0x%02x", static_cast<unsigned char>(c));
  }
  return shown;
}

std::string padded(uint64_t value, size_t width) {
  std::string digits = std::to_string(value);
  if (digits.size() < width) digits.insert(0, width - digits.size(), '0');
  return digits;
}

class NodelistParser {
 public:
  NodelistParser(const std::string& text, const char* name) : text_(text), name_(name) {}

  std::vector<HostPattern> parse() {
    if (text_.empty()) malformed("it is empty");
    std::vector<HostPattern> hosts;
    for (;;) {
      hosts.push_back(host());
      if (pos_ == text_.size()) return hosts;
      ++pos_;  // the ',' between hosts
      if (pos_ == text_.size()) malformed("a host name is missing after the last ','");
    }
  }

 private:
  [[noreturn]] void malformed(const std::string& why) const {
    fail_invalid("environment variable ", name_, " is ", quoted_value(text_), ", not a host list: ", why,
                 " (at character ", pos_ + 1, "); a host list is host names and bracketed ranges, such as ",
                 "node[003-005,010],gpu7");
  }

  HostPattern host() {
    HostPattern pieces;
    while (pos_ < text_.size() && text_[pos_] != ',') {
      const char c = text_[pos_];
      if (c == '[') {
        ++pos_;
        pieces.push_back(Piece{"", ranges()});
      } else if (c == ']') {
        malformed("']' closes no '['");
      } else if (is_host_char(c)) {
        if (pieces.empty() || !pieces.back().ranges.empty()) pieces.emplace_back();
        pieces.back().literal += c;
        ++pos_;
      } else {
        malformed(shown_char(c) + " cannot be in a host name");
      }
    }
    if (pieces.empty()) malformed("a host name is empty");
    return pieces;
  }

  // After '[': numbers and ranges separated by ',', up to and past ']'.
  std::vector<Range> ranges() {
    std::vector<Range> ranges;
    for (;;) {
      Range r;
      const std::string lo = digits("a number");
      r.lo = std::stoull(lo);
      r.hi = r.lo;
      r.width = lo.size();
      if (pos_ < text_.size() && text_[pos_] == '-') {
        ++pos_;
        r.hi = std::stoull(digits("a number after '-'"));
        if (r.hi < r.lo) malformed("the range " + lo + "-" + std::to_string(r.hi) + " goes down");
      }
      ranges.push_back(r);
      if (pos_ == text_.size()) malformed("a '[' is not closed");
      if (text_[pos_] == ']') {
        ++pos_;
        return ranges;
      }
      if (text_[pos_] != ',') malformed("expected ',', '-' or ']' in brackets");
      ++pos_;
    }
  }

  std::string digits(const char* what) {
    const size_t start = pos_;
    while (pos_ < text_.size() && text_[pos_] >= '0' && text_[pos_] <= '9') ++pos_;
    if (pos_ == start) malformed(std::string("expected ") + what);
    if (pos_ - start > kMaxDigits) {
      pos_ = start;
      malformed("a number has more than " + std::to_string(kMaxDigits) + " digits");
    }
    return text_.substr(start, pos_ - start);
  }

  const std::string& text_;
  const char* name_;
  size_t pos_ = 0;
};

// How many numbers a set names, at most `cap` + 1.
uint64_t set_size(const std::vector<Range>& ranges, uint64_t cap) {
  uint64_t n = 0;
  for (const Range& r : ranges) {
    n += r.hi - r.lo + 1;  // at most 10^18 each: no overflow before the cap stops it
    if (n > cap) return cap + 1;
  }
  return n;
}

}  // namespace

std::string quoted_value(const std::string& text) {
  constexpr size_t kShown = 80;
  if (text.size() <= kShown) return "'" + text + "'";
  return "'" + text.substr(0, kShown) + "...' (" + std::to_string(text.size()) + " characters)";
}

std::vector<std::string> expand_nodelist(const std::string& text, const char* name, size_t max_hosts) {
  const std::vector<HostPattern> patterns = NodelistParser(text, name).parse();
  std::vector<std::string> hosts;
  auto too_many = [&] {
    fail_invalid("environment variable ", name, " is ", quoted_value(text), ", which names more than ", max_hosts,
                 " hosts");
  };
  for (const HostPattern& pattern : patterns) {
    // How many hosts the pattern names, checked before any is made.
    uint64_t count = 1;
    for (const Piece& piece : pattern) {
      if (piece.ranges.empty()) continue;
      count *= set_size(piece.ranges, max_hosts);  // both <= max_hosts + 1 < 2^32: no overflow
      if (count > max_hosts) too_many();
    }
    if (hosts.size() + count > max_hosts) too_many();
    // An odometer over the sets, the last one turning fastest.
    std::vector<size_t> range_at(pattern.size(), 0);
    std::vector<uint64_t> value(pattern.size(), 0);
    for (size_t i = 0; i < pattern.size(); ++i) {
      if (!pattern[i].ranges.empty()) value[i] = pattern[i].ranges[0].lo;
    }
    for (uint64_t made = 0; made < count; ++made) {
      std::string host;
      for (size_t i = 0; i < pattern.size(); ++i) {
        const Piece& piece = pattern[i];
        host += piece.ranges.empty() ? piece.literal : padded(value[i], piece.ranges[range_at[i]].width);
      }
      hosts.push_back(std::move(host));
      for (size_t i = pattern.size(); i-- > 0;) {
        const std::vector<Range>& ranges = pattern[i].ranges;
        if (ranges.empty()) continue;
        if (value[i] < ranges[range_at[i]].hi) {
          ++value[i];
          break;
        }
        range_at[i] = range_at[i] + 1 == ranges.size() ? 0 : range_at[i] + 1;
        value[i] = ranges[range_at[i]].lo;
        if (range_at[i] != 0) break;  // else this set wrapped: carry into the one before
      }
    }
  }
  return hosts;
}

std::string first_host(const std::string& text, const char* name) {
  const std::vector<HostPattern> patterns = NodelistParser(text, name).parse();
  std::string host;
  for (const Piece& piece : patterns.front()) {
    host += piece.ranges.empty() ? piece.literal : padded(piece.ranges[0].lo, piece.ranges[0].width);
  }
  return host;
}

}  // namespace dparallel::dist
