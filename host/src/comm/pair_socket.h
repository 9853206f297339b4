// The socket of a Gloo TCP pair, which Gloo keeps protected: for reading its kernel counters
// (tcp_bytes_sent.cpp), for shutting it down to abort what waits on it and for naming the peer
// of a failed connection (gloo_ops.cpp).
#pragma once

#include <gloo/transport/tcp/pair.h>

#include <mutex>

namespace cai::comm {

// tcp::Pair keeps its socket (fd_) and the mutex guarding it (m_) protected. A class derived
// from Pair may name them, and &Derived::member names the base's member with type `T Pair::*`
// ([expr.unary.op]/3, [class.protected]/1), which then reads them from any Pair. Gloo changes
// fd_ (closing it after a failure or at teardown) only while holding m_ (pair.cc:
// "changeState must only be called when holding lock"), so a use under m_ never sees a
// closed or reused descriptor. The layout is that of the Gloo headers, which must match the
// libgloo linked (as for every other Gloo type used here).
class PairSocket : public gloo::transport::tcp::Pair {
 public:
  static constexpr int Pair::*kFd = &PairSocket::fd_;
  static constexpr std::mutex Pair::*kMutex = &PairSocket::m_;
  // The peer's address as Gloo's errors print it (Address::str()); set at connect, then
  // constant.
  static constexpr gloo::transport::tcp::Address Pair::*kPeer = &PairSocket::peer_;
};

// Calls fn(fd) with the pair's socket under the pair's lock; returns false without calling it
// when the pair has no socket (closed).
template <class Fn>
bool WithPairSocket(gloo::transport::tcp::Pair& pair, Fn&& fn) {
  std::lock_guard<std::mutex> lock(pair.*PairSocket::kMutex);
  const int fd = pair.*PairSocket::kFd;
  if (fd < 0) return false;
  fn(fd);
  return true;
}

}  // namespace cai::comm
