#include "lane/agreement.h"

#include <algorithm>
#include <cstring>
#include <sstream>

#include "comm/comm.h"
#include "core/error.h"
#include "lane/host_values.h"

namespace dparallel::lane {

namespace {

// Tensors broadcast at creation are this big at most per chunk.
constexpr size_t kStateBroadcastChunk = 64u << 20;

bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }

}  // namespace

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

std::vector<std::string> all_gather_strings(dist::ProcessGroup& group, const std::string& mine) {
  const Device device = group.device();
  const int32_t world = group.size();
  std::vector<Tensor> lengths = gather_outputs(world, DType::kInt64, 1, device);
  group.all_gather(to_device(host_int64({static_cast<int64_t>(mine.size())}), device), lengths, false);
  size_t longest = 0;
  std::vector<size_t> sizes;
  for (const Tensor& t : lengths) {
    int64_t n = read_int64(t).at(0);
    if (n < 0 || n > (int64_t(1) << 31)) fail(StatusCode::kRemote, "a rank sent a malformed length");
    sizes.push_back(static_cast<size_t>(n));
    longest = std::max(longest, static_cast<size_t>(n));
  }
  longest = std::max<size_t>(longest, 1);  // no empty all_gather
  Tensor padded = Tensor::zeros(DType::kUInt8, {static_cast<int64_t>(longest)}, kHostDevice);
  if (!mine.empty()) std::memcpy(padded.data(), mine.data(), mine.size());
  std::vector<Tensor> all = gather_outputs(world, DType::kUInt8, static_cast<int64_t>(longest), device);
  group.all_gather(to_device(padded, device), all, false);
  std::vector<std::string> out;
  out.reserve(static_cast<size_t>(world));
  for (int32_t r = 0; r < world; ++r) {
    Tensor host = to_device(all[r], kHostDevice);
    out.emplace_back(static_cast<const char*>(host.data()), sizes[r]);
  }
  return out;
}

// Every rank all-gathers every rank's description and reports the same first
// difference from rank 0 (or the lowest rank's own error).
void check_agreement(dist::ProcessGroup& group, const std::vector<std::string>& description) {
  const int32_t world = group.size();
  std::string mine;
  for (const auto& line : description) mine += line + "\n";
  std::vector<std::vector<std::string>> lines;
  for (const std::string& text : all_gather_strings(group, mine)) lines.push_back(split_lines(text));
  for (int32_t r = 0; r < world; ++r) {
    if (!lines[r].empty() && starts_with(lines[r][0], "error ")) {
      fail_invalid("rank ", r, " refused: ", lines[r][0].substr(6));
    }
  }
  for (int32_t r = 1; r < world; ++r) {
    size_t n = std::max(lines[r].size(), lines[0].size());
    for (size_t i = 0; i < n; ++i) {
      std::string theirs = i < lines[r].size() ? lines[r][i] : "(nothing more)";
      std::string first = i < lines[0].size() ? lines[0][i] : "(nothing more)";
      if (theirs == first) continue;
      fail_invalid("rank ", r, " disagrees with rank 0: rank ", r, " has ", theirs, " but rank 0 has ", first);
    }
  }
}

// Broadcasts `tensors` from `root`, coalesced per dtype.
void broadcast_tensors(dist::ProcessGroup& group, const std::vector<Tensor>& list, int32_t root) {
  if (list.empty() || group.size() == 1) return;
  const Device device = group.device();
  for (const auto& chunk : comm::take_tensors(list, kStateBroadcastChunk)) {
    std::vector<Tensor> pieces;
    pieces.reserve(chunk.size());
    for (size_t i : chunk) pieces.push_back(list[i]);
    int64_t numel = comm::total_numel(pieces);
    if (numel == 0) continue;
    Tensor flat = Tensor::empty(pieces.front().dtype(), {numel}, device);
    comm::flatten_into(flat, pieces);
    group.broadcast(flat, root, false);
    if (group.rank() != root) comm::unflatten_into(pieces, flat);
  }
}

}  // namespace dparallel::lane
