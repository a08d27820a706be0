// Under dp-run (which sets DP_LINE_BUFFERED_STDOUT=1), the program's stdout
// is line-buffered when the library loads: dp-run reads it through a pipe,
// where C stdio would otherwise hold each line until 4 KiB accumulate.
// Built into every binary as an object (src/CMakeLists.txt), so that its
// initialiser runs, before main for a program linked against the library.
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace dparallel {

namespace {

[[maybe_unused]] const bool g_stdout_line_buffered = [] {
  const char* text = std::getenv("DP_LINE_BUFFERED_STDOUT");
  if (text == nullptr || std::strcmp(text, "1") != 0) return false;
  // Without a buffer of its own, this only switches the mode, which glibc
  // allows also after output (a library loaded late by a Java, C# or Go host).
  return std::setvbuf(stdout, nullptr, _IOLBF, 0) == 0;
}();

}  // namespace

}  // namespace dparallel
