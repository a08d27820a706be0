#include "distributed/background_calls.h"

#include <atomic>

namespace dparallel::dist {

namespace {

thread_local bool t_background = false;
std::atomic<int> g_awaited{0};

}  // namespace

void BackgroundCalls::mark_this_thread() { t_background = true; }

bool BackgroundCalls::may_spin() { return !t_background || g_awaited.load(std::memory_order_relaxed) > 0; }

BackgroundCalls::Awaited::Awaited() { g_awaited.fetch_add(1, std::memory_order_relaxed); }

BackgroundCalls::Awaited::~Awaited() { g_awaited.fetch_sub(1, std::memory_order_relaxed); }

}  // namespace dparallel::dist
