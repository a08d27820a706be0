// Slurm's host lists, as in SLURM_JOB_NODELIST: "node[003-005,010],gpu7" is
// node003, node004, node005, node010 and gpu7.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace dparallel::dist {

// The hosts `text` names, in order. A host is host-name characters
// (letters, digits, '.', '-', '_') and bracketed sets of numbers and
// ranges ("[1-3,7]"); a number keeps the zero padding of a range's lower
// end ("[08-10]": 08, 09, 10), and several sets in one host multiply
// ("r[1-2]n[1-2]": r1n1, r1n2, r2n1, r2n2). Hosts are separated by
// commas outside brackets. Malformed text, or more than `max_hosts` hosts
// (below 2^32),
// is kInvalidArgument naming the environment variable `name` and where
// the text goes wrong.
std::vector<std::string> expand_nodelist(const std::string& text, const char* name, size_t max_hosts);

// The first host of `text`; the whole text is checked as expand_nodelist
// does, but not expanded.
std::string first_host(const std::string& text, const char* name);

// `text`, quoted, its first 80 characters when longer (an environment
// variable's value in a message).
std::string quoted_value(const std::string& text);

}  // namespace dparallel::dist
