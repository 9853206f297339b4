#include "comm/tcp_bytes_sent.h"

#include <linux/tcp.h>  // struct tcp_info with tcpi_bytes_sent; glibc's netinet/tcp.h predates it
#include <netinet/in.h>
#include <sys/socket.h>

#include <cstddef>
#include <utility>

#include "comm/pair_socket.h"

namespace cai::comm {

namespace {

using gloo::transport::tcp::Pair;

// The tcp_info prefix that holds tcpi_bytes_sent and tcpi_bytes_retrans (Linux 4.19+);
// tcpi_notsent_bytes precedes them.
constexpr socklen_t kNeeded = offsetof(tcp_info, tcpi_bytes_retrans) + sizeof(__u64);

// The connection's bytes sent once and written-but-unsent; false when it cannot be read
// (closed).
bool ReadSocket(Pair& pair, uint64_t& out) {
  bool read = false;
  WithPairSocket(pair, [&](int fd) {
    tcp_info info{};
    socklen_t len = sizeof(info);
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) != 0 || len < kNeeded) return;
    out = info.tcpi_bytes_sent - info.tcpi_bytes_retrans + info.tcpi_notsent_bytes;
    read = true;
  });
  return read;
}

}  // namespace

std::unique_ptr<TcpBytesSent> TcpBytesSent::Open(std::span<gloo::Context* const> contexts) {
  std::vector<Pair*> pairs;
  for (gloo::Context* context : contexts) {
    for (int peer = 0; peer < context->size; ++peer) {
      if (peer == context->rank) continue;
      auto* pair = dynamic_cast<Pair*>(context->getPair(peer).get());
      uint64_t probe = 0;
      if (pair == nullptr || !ReadSocket(*pair, probe)) return nullptr;
      pairs.push_back(pair);
    }
  }
  return std::unique_ptr<TcpBytesSent>(new TcpBytesSent(std::move(pairs)));
}

TcpBytesSent::TcpBytesSent(std::vector<Pair*> pairs)
    : pairs_(std::move(pairs)), last_(pairs_.size(), 0) {}

uint64_t TcpBytesSent::Read() {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t total = 0;
  for (size_t i = 0; i < pairs_.size(); ++i) {
    uint64_t now = 0;
    if (ReadSocket(*pairs_[i], now) && now > last_[i]) last_[i] = now;
    total += last_[i];
  }
  return total;
}

}  // namespace cai::comm
