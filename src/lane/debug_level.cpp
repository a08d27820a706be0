#include "lane/debug_level.h"

#include <cctype>
#include <cstdlib>
#include <string>

namespace dparallel::lane {

DebugLevel debug_level_from_env() {
  const char* text = std::getenv("DP_DEBUG");
  if (text == nullptr) return DebugLevel::kOff;
  std::string level(text);
  for (char& c : level) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (level == "DETAIL") return DebugLevel::kDetail;
  if (level == "INFO") return DebugLevel::kInfo;
  return DebugLevel::kOff;
}

}  // namespace dparallel::lane
