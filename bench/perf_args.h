// Option values for dp-perf and dp-perf-dist, checked strictly: a bad value
// throws perf::UsageError naming the option, what it takes and what it got.
// Sizes are also checked against the memory this machine has free.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <stdexcept>
#include <string>

namespace perf {

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Larger sizes are refused before any arithmetic on them can overflow.
constexpr double kMaxSize = 1024.0 * 1024 * 1024 * 1024;  // 1 TiB

[[noreturn]] inline void bad_value(const std::string& flag, const std::string& text, const std::string& takes) {
  throw UsageError(flag + " takes " + takes + ", not '" + text + "'");
}

// A byte count: a number of at least 1 with an optional K, M or G suffix (powers of 1024).
inline size_t parse_size(const std::string& flag, const std::string& text) {
  const char* takes = "a size from 1 to 1024G (K, M, G: powers of 1024)";
  char* end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str()) bad_value(flag, text, takes);
  double scale = 1;
  switch (*end) {
    case 'K':
    case 'k':
      scale = 1024.0;
      ++end;
      break;
    case 'M':
    case 'm':
      scale = 1024.0 * 1024;
      ++end;
      break;
    case 'G':
    case 'g':
      scale = 1024.0 * 1024 * 1024;
      ++end;
      break;
    default:
      break;
  }
  double bytes = value * scale;
  if (*end != '\0' || !std::isfinite(bytes) || bytes < 1 || bytes > kMaxSize) bad_value(flag, text, takes);
  return static_cast<size_t>(bytes);
}

// A decimal integer in min..max.
inline long parse_int(const std::string& flag, const std::string& text, long min, long max) {
  char* end = nullptr;
  errno = 0;
  long value = std::strtol(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0' || errno != 0 || value < min || value > max) {
    bad_value(flag, text, "an integer in " + std::to_string(min) + ".." + std::to_string(max));
  }
  return value;
}

// The growth factor between sizes: a number above 1, at most 1024.
inline double parse_factor(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || *end != '\0' || !std::isfinite(value) || value <= 1.0 || value > 1024.0) {
    bad_value(flag, text, "a number above 1 and at most 1024");
  }
  return value;
}

// The sizes from min to max, each `factor` times the one before; a factor
// this close to 1 would make a run that never ends.
inline void check_size_steps(size_t min_bytes, size_t max_bytes, double factor) {
  constexpr double kMaxSteps = 1000;
  if (min_bytes > max_bytes) {
    throw UsageError("-b " + std::to_string(min_bytes) + " is above -e " + std::to_string(max_bytes) +
                     ": the first size must not exceed the last");
  }
  double steps = std::log(static_cast<double>(max_bytes) / static_cast<double>(min_bytes)) / std::log(factor);
  if (steps + 1 > kMaxSteps) {
    char text[32];
    std::snprintf(text, sizeof text, "%g", factor);
    throw UsageError("-f " + std::string(text) + " makes " + std::to_string(static_cast<long long>(steps) + 1) +
                     " sizes from -b to -e; at most " + std::to_string(static_cast<int>(kMaxSteps)));
  }
}

inline std::string format_bytes(double bytes) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f GiB", bytes / (1024.0 * 1024 * 1024));
  return text;
}

// Bytes this process can still allocate: the smaller of the system's
// available memory and what its cgroup (v2) allows.
inline double available_memory() {
  double available = -1;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string key; meminfo >> key;) {
    double kib = 0;
    meminfo >> kib;
    if (key == "MemAvailable:") {
      available = kib * 1024.0;
      break;
    }
    meminfo.ignore(256, '\n');
  }
  if (available < 0) {
    available = static_cast<double>(::sysconf(_SC_AVPHYS_PAGES)) * static_cast<double>(::sysconf(_SC_PAGESIZE));
  }
  std::ifstream cgroup_of_self("/proc/self/cgroup");
  for (std::string line; std::getline(cgroup_of_self, line);) {
    if (line.rfind("0::", 0) != 0) continue;
    std::string dir = "/sys/fs/cgroup" + line.substr(3);
    std::ifstream max_file(dir + "/memory.max"), current_file(dir + "/memory.current");
    double max = 0, current = 0;
    if (max_file >> max && current_file >> current) available = std::min(available, max - current);
  }
  return available;
}

// Refuses a run whose buffers would not fit in the memory left.
inline void check_fits(const std::string& what, double needed_bytes) {
  double available = available_memory();
  if (needed_bytes > available) {
    throw UsageError(what + " needs about " + format_bytes(needed_bytes) + " of memory; " + format_bytes(available) +
                     " is available");
  }
}

}  // namespace perf
