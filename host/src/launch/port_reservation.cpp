#include "launch/port_reservation.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/status.h"

namespace cai::launch {

PortReservation::PortReservation(const std::string& addr) {
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd_ < 0) throw Error(CAI_UNAVAILABLE, std::string("socket: ") + std::strerror(errno));
  const int one = 1;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = 0;
  if (::inet_pton(AF_INET, addr.c_str(), &sa.sin_addr) != 1) sa.sin_addr.s_addr = INADDR_ANY;
  socklen_t len = sizeof(sa);
  const bool ok = ::setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) == 0 &&
                  ::bind(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0 &&
                  ::getsockname(fd_, reinterpret_cast<sockaddr*>(&sa), &len) == 0;
  if (!ok) {
    const int err = errno;
    ::close(fd_);
    throw Error(CAI_UNAVAILABLE, "could not find a free port on " + addr + ": " +
                                     std::strerror(err) + " (set launch.master_port)");
  }
  port_ = ntohs(sa.sin_port);
}

PortReservation::~PortReservation() {
  if (fd_ >= 0) ::close(fd_);
}

void PortReservation::CloseInChild() {
  ::close(fd_);
  fd_ = -1;
}

}  // namespace cai::launch
