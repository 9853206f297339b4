// A ring through shared memory, for the ranks of a group that share a host: reduce_scatter,
// all_gather and all_reduce without the kernel's socket copies.
//
// Each rank owns an outbox (a POSIX shared-memory segment of kSlots slots of kSlotBytes) that
// only it writes and only its right neighbour reads, and maps its left neighbour's. A message
// is one slot; the owner publishes it by advancing `seq`, the reader frees it by advancing
// `ack`, and each side sleeps on the other's counter with a futex. The algorithms run
// segment-major (all n-1 steps of one segment before the next segment), which needs no more
// than two slots to be deadlock-free; the rest let a rank run ahead of its neighbour. A
// reduce-scatter step adds the left neighbour's partial to this rank's input straight into its
// own outbox: one pass, no intermediate copy.
//
// Setting up is collective (Open): every rank creates its outbox under a random name, the names
// travel by all-gather, each rank maps its left neighbour's and checks it, and the ranks agree
// on the outcome by a second all-gather. Every name is unlinked once all ranks have mapped (or
// failed to), so nothing stays in /dev/shm after the setup. If any rank cannot map, every rank
// gets nullptr and the group keeps its TCP path.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "comm/gloo_ops.h"

namespace cai::comm {

class ShmRing {
 public:
  static constexpr size_t kSlots = 8;
  static constexpr size_t kSlotBytes = size_t{256} << 10;

  // Every rank's values, rank by rank (a collective on the ranks that open the ring).
  using Exchange = std::function<std::vector<int64_t>(std::span<const int64_t>)>;
  // Called every few milliseconds while waiting on a neighbour; throws (as Gloo does, with
  // "closed by peer <address>") when the neighbour is known to be gone.
  using CheckPeers = std::function<void()>;

  // Collective over the `size` ranks. nullptr on every rank when any rank could not map its
  // neighbour's outbox (other hosts, no /dev/shm, out of space); `why_not` then says why, as
  // this rank saw it.
  static std::unique_ptr<ShmRing> Open(int rank, int size, const Exchange& all_gather,
                                       std::string* why_not);
  ~ShmRing();
  ShmRing(const ShmRing&) = delete;
  ShmRing& operator=(const ShmRing&) = delete;

  // What this ring runs: all_reduce, reduce_scatter and all_gather (of host memory).
  static bool Runs(cai_comm_op op);
  static bool Runs(const OpSpec& spec);
  // Runs one of them to completion by spec.timeout. Throws std::runtime_error with "Timed out"
  // on the deadline and whatever `check` throws for a lost neighbour; after a throw the ring's
  // message counters no longer match its neighbours' and it must not be used again.
  void Run(const OpSpec& spec, const CheckPeers& check);
  // Streams `bytes` to the right neighbour while receiving as much from the left (each rank at
  // once), copied into the slots from `src` and out of them into `dst`, both of `window` bytes
  // and reused cyclically: the benchmark's measure of this ring. A window of one slot stays in
  // cache, so nothing but the slots' own traffic limits it (the transport's ceiling); a window
  // as large as `bytes` is a copy between two processes' buffers in memory.
  void Stream(const std::byte* src, std::byte* dst, size_t window, size_t bytes,
              std::chrono::milliseconds timeout, const CheckPeers& check);
  // Wakes and fails whatever waits in Run or Stream, now and from then on.
  void Abort();
  // Bytes this rank has written into its outbox for its neighbour: the ring's wire bytes.
  uint64_t BytesSent() const { return bytes_sent_.load(std::memory_order_relaxed); }

  struct Header;

 private:
  class Scope;
  ShmRing(int rank, int size);
  std::byte* BeginSend();
  void EndSend(size_t bytes);
  const std::byte* BeginReceive();
  void EndReceive();
  void WaitFor(std::atomic<uint32_t>& counter, uint32_t target, const char* what);

  void ReduceScatter(const OpSpec& spec);
  void AllGather(const OpSpec& spec);
  void AllReduce(const OpSpec& spec);

  int rank_, size_;
  Header* own_ = nullptr;   // this rank's outbox
  Header* left_ = nullptr;  // the left neighbour's
  size_t mapped_bytes_ = 0;
  uint32_t sent_ = 0;      // messages published into own_
  uint32_t received_ = 0;  // messages consumed from left_
  std::atomic<bool> aborted_{false};
  std::atomic<uint64_t> bytes_sent_{0};
  // The operation in progress: its deadline and peer check.
  std::chrono::steady_clock::time_point deadline_;
  const CheckPeers* check_ = nullptr;
};

}  // namespace cai::comm
