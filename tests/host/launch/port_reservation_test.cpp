#include "launch/port_reservation.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace cai::launch {
namespace {

// A loopback TCP socket bound to `port` (0: any), with SO_REUSEADDR if `reuse`; -1 if the
// bind fails, with errno kept. *bound receives the port it got.
int Bind(int port, bool reuse, int* bound = nullptr) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  const int one = 1;
  if (reuse) ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    const int err = errno;
    ::close(fd);
    errno = err;
    return -1;
  }
  socklen_t len = sizeof(sa);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&sa), &len);
  if (bound) *bound = ntohs(sa.sin_port);
  return fd;
}

// The race it closes: a port probed and released could be handed to the next asker for port 0
// (another job's probe, a gloo listener) before the store binds it.
TEST(PortReservation, NoOneAskingForAnyPortGetsItWhileTheStoreCanListenOnIt) {
  const PortReservation reserved("127.0.0.1");
  const int port = reserved.port();
  ASSERT_GT(port, 0);

  for (int i = 0; i < 2000; ++i) {
    int got = 0;
    const int fd = Bind(0, /*reuse=*/i % 2 == 0, &got);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    ::close(fd);
    ASSERT_NE(got, port) << "try " << i << " was handed the reserved port";
  }
  EXPECT_EQ(Bind(port, /*reuse=*/false), -1) << "a socket without SO_REUSEADDR bound it";
  EXPECT_EQ(errno, EADDRINUSE);

  // The rendezvous store binds with SO_REUSEADDR and listens; a rank then connects.
  const int server = Bind(port, /*reuse=*/true);
  ASSERT_GE(server, 0) << std::strerror(errno);
  ASSERT_EQ(::listen(server, 4), 0) << std::strerror(errno);
  const int client = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(client, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0)
      << std::strerror(errno);
  ::close(client);
  ::close(server);
}

TEST(PortReservation, ReleasesThePortWhenDestroyed) {
  int port = 0;
  { port = PortReservation("127.0.0.1").port(); }
  const int fd = Bind(port, /*reuse=*/false);
  EXPECT_GE(fd, 0) << "port " << port << " still held: " << std::strerror(errno);
  if (fd >= 0) ::close(fd);
}

}  // namespace
}  // namespace cai::launch
