// The address a group's transports advertise, from the inside.
#include <gtest/gtest.h>

#include <cstdlib>

#include "distributed/rendezvous.h"
#include "distributed/store/tcp_store.h"

namespace dparallel::dist {
namespace {

TEST(AdvertisedHost, IsTheLocalAddressOfTheTcpStoreConnection) {
  ::unsetenv("DP_SOCKET_IFNAME");
  TcpStoreOptions store_options;
  store_options.host = "127.0.0.1";
  store_options.is_server = true;
  store_options.timeout = Millis(5000);
  auto store = std::make_shared<TcpStore>(store_options);
  ProcessGroupOptions options;
  options.store = store;
  // A master address on another host: the host name could resolve to 127.0.1.1.
  options.master_addr = "192.0.2.1";
  EXPECT_EQ(advertised_host(options), "127.0.0.1");
}

TEST(AdvertisedHost, IsLoopbackForAFileStoreOnOneHost) {
  ProcessGroupOptions options;
  EXPECT_EQ(advertised_host(options), "127.0.0.1");
}

}  // namespace
}  // namespace dparallel::dist
