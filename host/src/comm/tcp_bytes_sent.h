// What a Gloo context's TCP connections have put on the wire, from the kernel's own counters:
// the wire side of the communicator's byte counters (the other side counts bytes handed to an
// operation, a size computed from its arguments).
#pragma once

#include <gloo/context.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

namespace gloo::transport::tcp {
class Pair;
}

namespace cai::comm {

// The connections of a group's contexts (one per peer and lane), read with getsockopt(TCP_INFO). A
// reading is tcpi_bytes_sent - tcpi_bytes_retrans + tcpi_notsent_bytes summed over the connections:
// TCP payload bytes transmitted once, plus those written to a socket but not yet transmitted, so
// that bytes an operation wrote count for it even when the kernel sends them after it has
// returned. Gloo's framing (a 48-byte preamble per message and per send/recv-ready
// notification) is payload too; TCP/IP headers are not. Retransmissions are left out: they
// are TCP's, not the algorithm's, and even loopback has them when a loaded machine delays
// ACKs past the retransmission timer (32 KiB of a 2 MiB reduce-scatter, seen here).
// Thread-safe.
class TcpBytesSent {
 public:
  // nullptr when this kernel's TCP_INFO has no tcpi_bytes_retrans (Linux < 4.19) or a context
  // has a connection that is not Gloo TCP. The contexts must be connected (connectFullMesh)
  // and outlive the returned object.
  static std::unique_ptr<TcpBytesSent> Open(std::span<gloo::Context* const> contexts);

  // Bytes sent so far by all the connections; never decreases (a connection Gloo has closed
  // after a failure keeps its last reading).
  uint64_t Read();

 private:
  explicit TcpBytesSent(std::vector<gloo::transport::tcp::Pair*> pairs);

  std::vector<gloo::transport::tcp::Pair*> pairs_;
  std::mutex mu_;
  std::vector<uint64_t> last_;  // per connection; guarded by mu_
};

}  // namespace cai::comm
