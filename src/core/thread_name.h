// The names the library gives its own threads ("dp-dev cpu:0", "dp-pool",
// "dp-lane", "dp-stream cpu:0"): what debuggers and /proc show.
#pragma once

#include <pthread.h>

#include <string>

namespace dparallel {

// Names the calling thread; Linux keeps the first 15 characters.
inline void name_this_thread(std::string name) {
  if (name.size() > 15) name.resize(15);
  pthread_setname_np(pthread_self(), name.c_str());
}

}  // namespace dparallel
