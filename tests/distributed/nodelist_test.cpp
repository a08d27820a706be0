// Slurm's host lists (SLURM_JOB_NODELIST) expanded, and garbage refused.
#include "distributed/nodelist.h"

#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "error_util.h"

namespace dparallel::dist {
namespace {

using Hosts = std::vector<std::string>;
constexpr const char* kVar = "SLURM_JOB_NODELIST";

Hosts expand(const std::string& text, size_t max_hosts = 1000) { return expand_nodelist(text, kVar, max_hosts); }

TEST(Nodelist, ExpandsRangesAndListsKeepingZeroPadding) {
  EXPECT_EQ(expand("node[003-005,010],gpu7"), (Hosts{"node003", "node004", "node005", "node010", "gpu7"}));
  EXPECT_EQ(expand("node[099-101]"), (Hosts{"node099", "node100", "node101"}));
  EXPECT_EQ(expand("node[08-10]"), (Hosts{"node08", "node09", "node10"}));
  EXPECT_EQ(expand("node[8-10]"), (Hosts{"node8", "node9", "node10"}));
  EXPECT_EQ(expand("n[0007]"), (Hosts{"n0007"}));
  EXPECT_EQ(expand("n[1,3,5-6]"), (Hosts{"n1", "n3", "n5", "n6"}));
}

TEST(Nodelist, ExpandsHostsWithoutBracketsAndSeveralGroups) {
  EXPECT_EQ(expand("gpu7"), (Hosts{"gpu7"}));
  EXPECT_EQ(expand("a,b,c"), (Hosts{"a", "b", "c"}));
  EXPECT_EQ(expand("host-1.example.com,host_2"), (Hosts{"host-1.example.com", "host_2"}));
  EXPECT_EQ(expand("a[1-2],b,c[09-10]"), (Hosts{"a1", "a2", "b", "c09", "c10"}));
  EXPECT_EQ(expand("cpu[1-2],gpu[01-02]"), (Hosts{"cpu1", "cpu2", "gpu01", "gpu02"}));
}

TEST(Nodelist, ExpandsTextAfterBracketsAndSeveralBracketsInOneHost) {
  EXPECT_EQ(expand("n[1-2]-ib"), (Hosts{"n1-ib", "n2-ib"}));
  EXPECT_EQ(expand("r[1-2]n[01-02]"), (Hosts{"r1n01", "r1n02", "r2n01", "r2n02"}));
  EXPECT_EQ(expand("[1-3]"), (Hosts{"1", "2", "3"}));
  EXPECT_EQ(expand("x[1-2][7,9]"), (Hosts{"x17", "x19", "x27", "x29"}));
}

TEST(Nodelist, FirstHostIsTheFirstOfTheExpansion) {
  EXPECT_EQ(first_host("node[003-005,010],gpu7", kVar), "node003");
  EXPECT_EQ(first_host("gpu7,node[1-2]", kVar), "gpu7");
  EXPECT_EQ(first_host("r[2-3]n[010-011]-ib", kVar), "r2n010-ib");
  EXPECT_EQ(first_host("node[10,2-3]", kVar), "node10");
}

TEST(Nodelist, FirstHostOfAHugeRangeIsFoundWithoutExpandingIt) {
  EXPECT_EQ(first_host("n[000000000000000001-999999999999999999]x[0-999999999]", kVar), "n000000000000000001x0");
}

TEST(Nodelist, RefusesMoreHostsThanTheLimit) {
  EXPECT_EQ(expand("a[1-3]", 3).size(), 3u);
  std::string why = dptest::invalid_argument_error_of([] { expand("a[1-3]", 2); });
  EXPECT_TRUE(dptest::contains(why, "SLURM_JOB_NODELIST is 'a[1-3]', which names more than 2 hosts")) << why;
  why = dptest::invalid_argument_error_of([] { expand("a,b,c[1-2]", 3); });
  EXPECT_TRUE(dptest::contains(why, "more than 3 hosts")) << why;
  // Sizes past 2^64 when multiplied out are refused, not wrapped around.
  why = dptest::invalid_argument_error_of(
      [] { expand("n[0-999999999999999999][0-999999999999999999][0-999999999999999999]"); });
  EXPECT_TRUE(dptest::contains(why, "more than 1000 hosts")) << why;
}

struct Garbage {
  const char* text;
  const char* why;
};

void PrintTo(const Garbage& g, std::ostream* os) { *os << "'" << g.text << "'"; }

class NodelistGarbage : public ::testing::TestWithParam<Garbage> {};

TEST_P(NodelistGarbage, IsInvalidNamingTheVariableAndWhy) {
  const Garbage g = GetParam();
  std::string why = dptest::invalid_argument_error_of([&] { expand(g.text); });
  EXPECT_TRUE(dptest::contains(why, "environment variable SLURM_JOB_NODELIST is ")) << why;
  EXPECT_TRUE(dptest::contains(why, g.why)) << why;
  // first_host checks the whole text too.
  std::string first_why = dptest::invalid_argument_error_of([&] { first_host(g.text, kVar); });
  EXPECT_EQ(first_why, why);
}

INSTANTIATE_TEST_SUITE_P(
    Texts, NodelistGarbage,
    ::testing::Values(Garbage{"", "it is empty"}, Garbage{",", "a host name is empty (at character 1)"},
                      Garbage{"a,", "a host name is missing after the last ','"}, Garbage{",a", "a host name is empty"},
                      Garbage{"a,,b", "a host name is empty (at character 3)"},
                      Garbage{"node[", "expected a number (at character 6)"},
                      Garbage{"node[1-", "expected a number after '-'"}, Garbage{"node[1-2", "a '[' is not closed"},
                      Garbage{"node[1", "a '[' is not closed"}, Garbage{"node]", "']' closes no '['"},
                      Garbage{"node[1]]", "']' closes no '['"}, Garbage{"node[]", "expected a number"},
                      Garbage{"node[a]", "expected a number"}, Garbage{"node[3-1]", "the range 3-1 goes down"},
                      Garbage{"node[1,]", "expected a number"}, Garbage{"node[,1]", "expected a number"},
                      Garbage{"node[1-2-3]", "expected ',', '-' or ']' in brackets"},
                      Garbage{"node[[1]]", "expected a number"}, Garbage{"node[ 1]", "expected a number"},
                      Garbage{"node[-1]", "expected a number"}, Garbage{"no de", "' ' cannot be in a host name"},
                      Garbage{"a b,c", "cannot be in a host name (at character 2)"},
                      Garbage{"node\x01", "byte 0x01 cannot be in a host name"},
                      Garbage{"n\xc3\xa9", "byte 0xc3 cannot be in a host name"},
                      Garbage{"node;rm", "';' cannot be in a host name"},
                      Garbage{"node[1234567890123456789]", "a number has more than 18 digits"},
                      Garbage{"node[1-99999999999999999999999]", "a number has more than 18 digits"}));

TEST(Nodelist, ALongMalformedValueIsShownCutShort) {
  const std::string text = std::string(5000, 'a') + "[";
  std::string why = dptest::invalid_argument_error_of([&] { expand(text); });
  EXPECT_TRUE(dptest::contains(why, "...' (5001 characters)")) << why.substr(0, 300);
  EXPECT_LT(why.size(), 600u);
}

}  // namespace
}  // namespace dparallel::dist
