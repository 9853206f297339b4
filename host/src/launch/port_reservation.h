// A port for a rendezvous store, held from the moment it is chosen until the job ends.
//
// Choosing a free port by binding port 0 and closing the socket leaves a window before the
// store binds it: another job's probe, or a connection of its gloo pairs, may be handed the
// same port, and a rank may then meet another job's store. The reservation instead keeps its
// socket bound, with SO_REUSEADDR and never listening, for its lifetime. Linux then gives the
// port to no one who asks for port 0, while the store, which binds with SO_REUSEADDR too, may
// still bind and listen on it.
#pragma once

#include <string>

namespace cai::launch {

class PortReservation {
 public:
  // Holds a free port on `addr` (an IPv4 address; any other text holds it on every address).
  // Throws Error(CAI_UNAVAILABLE) naming `addr` if the kernel gives none.
  explicit PortReservation(const std::string& addr);
  ~PortReservation();
  PortReservation(const PortReservation&) = delete;
  PortReservation& operator=(const PortReservation&) = delete;

  int port() const { return port_; }
  // In a child forked without exec: closes its copy of the socket (the parent keeps holding
  // the port), as exec would.
  void CloseInChild();

 private:
  int fd_ = -1;
  int port_ = 0;
};

}  // namespace cai::launch
