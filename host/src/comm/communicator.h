// The host's communicator: one per process, Gloo over TCP on CPU tensors.
//
// This is the C++ side of cai_comm_api (abi/include/cai/comm.h); CommApi() in comm_api.h wraps
// it for plugins. Free of LibTorch and Gloo headers so the rest of the host can include it.
//
// Errors are thrown as cai::Error with the ABI's status codes: INVALID_ARGUMENT for bad
// arguments, DEADLINE_EXCEEDED for timeouts (the message names the operation, the group, this
// rank and, where the store can tell, the rank that did not answer), UNAVAILABLE when a peer
// went away, FAILED_PRECONDITION for a group broken by an earlier failure, INVALID_ARGUMENT
// when the ranks of a group called different collectives (the call check below).
//
// Failure detection (comm/liveness.h): every rank sends heartbeats over UDP; a peer that stops
// (killed, hung, SIGSTOPped, its node lost) is noticed within heartbeat_timeout + 0.5 s,
// whatever the collective timeout. The communicator is then aborted:
// every group's connections are shut down, so operations in flight fail at once with
// UNAVAILABLE and the report (which rank, what it and this rank were doing), later ones fail
// with FAILED_PRECONDITION; then on_peer_failure, if set, is called.
//
// Call check (on by default, like PyTorch's TORCH_DISTRIBUTED_DEBUG=DETAIL): before each Gloo
// collective the group's ranks all-gather a fingerprint of their call (operation, reduce op,
// dtype, element counts, root) on connections of its own, so a rank that calls a different
// collective, shape or dtype fails every rank of the group with each rank's call listed,
// instead of hanging or mixing buffers. It costs one small all-gather per collective.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cai/comm.h"

namespace cai {

struct CommOptions {
  int rank = 0;
  int world_size = 1;
  // Where rank 0 serves the rendezvous store (c10d's TCPStore).
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  // Default timeout of every operation and of the rendezvous itself.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // Local address the collectives bind to. Empty: the IPv4 address of socket_ifname when one
  // is named, else loopback when master_addr is a loopback address, otherwise the local
  // address the kernel routes to master_addr from.
  std::string bind_addr;
  // Network interface the collectives bind to (as GLOO_SOCKET_IFNAME). Empty: the
  // CAI_SOCKET_IFNAME environment variable, else GLOO_SOCKET_IFNAME (its first name), else
  // none. An interface without an IPv4 address fails Init with the interfaces there are.
  std::string socket_ifname;
  // A peer silent this long is lost (comm/liveness.h); zero turns failure detection off.
  std::chrono::milliseconds heartbeat_timeout{5000};
  // Called once, on a monitor thread, after the communicator was aborted for a lost peer,
  // with the report; may end the process. Empty: only the abort.
  std::function<void(const std::string& report)> on_peer_failure;
  // Check, before each collective, that every rank of the group calls the same one.
  bool check_calls = true;
  // Connections (and Gloo I/O threads) per peer that a large all_reduce, reduce_scatter or
  // all_gather is split over (comm::RunCollective). One thread serves all of a Gloo device's
  // connections, sending and receiving in turn; a second lane lets a rank send and receive at
  // once. 1 = Gloo's single connection.
  int lanes = 2;
  // all_reduce, reduce_scatter and all_gather of a group whose ranks all share this host go
  // through shared memory (comm/shm_ring.h) rather than TCP; false keeps every group on TCP.
  bool shared_memory = true;
};

// Bytes this rank's sockets actually sent for each operation, measured by the kernel (TCP_INFO)
// rather than computed from the arguments: a reduce-scatter done as an all-reduce shows here as
// twice the bytes. Per operation kind, indexed by cai_comm_op.
//
// What counts: the TCP payload sent on the group's connections while the operation ran, Gloo's
// 48-byte message and notification preambles included; not TCP/IP headers, not TCP's
// retransmissions (comm/tcp_bytes_sent.h). A collective through shared memory counts the bytes
// it wrote into its outbox for its neighbour (comm/shm_ring.h), its algorithm's volume exactly.
// Collectives run one at a time on their group's worker, which reads the group's connections before
// and after each: everything sent in between is that collective's, counted when it completes.
// Point-to-point operations complete on another thread, so they get what the connections sent
// outside any collective since the previous send or recv completed (their data, and their ready
// notifications); a send overlapping a collective on the same group is counted in the collective.
// Totals over all operations are exact either way.
//
// NCCL (CUDA tensors) moves its bytes over NVLink, PCIe or the network without the host
// seeing them: such operations add nothing to `bytes` and one to `unmeasured_calls`; so do
// operations on a kernel whose TCP_INFO lacks tcpi_bytes_retrans (Linux < 4.19).
struct WireCounters {
  std::array<uint64_t, CAI_COMM_NUM_OPS> bytes{};
  std::array<uint64_t, CAI_COMM_NUM_OPS> unmeasured_calls{};
};

class Communicator {
 public:
  // Rendezvous of all world ranks; every rank calls it with the same world_size, master_addr
  // and master_port. Throws FAILED_PRECONDITION when a communicator already exists, and
  // DEADLINE_EXCEEDED naming the ranks that did not arrive within options.timeout.
  static Communicator& Init(const CommOptions& options);
  // The process's communicator, or nullptr before Init / after Shutdown. Thread-safe.
  static Communicator* Get();
  // Waits for queued operations, then tears down every group and the store. Not thread-safe
  // with respect to operations still being issued.
  static void Shutdown();

  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Thread-safe, as are all members below unless stated.
  int rank() const;
  int world_size() const;
  cai_comm_group* world();
  int GroupRank(const cai_comm_group* group) const;  // nullptr = world
  int GroupSize(const cai_comm_group* group) const;  // nullptr = world

  // Collective over the world: every rank passes the same list. Returns nullptr on ranks not in
  // the list. The group is owned by the caller and released with DestroyGroup.
  cai_comm_group* NewGroup(std::span<const int32_t> world_ranks);
  void DestroyGroup(cai_comm_group* group);

  // Validates `args`, counts the operation, and queues it on its group's worker thread, which
  // runs the group's operations in issue order. The returned work is owned by the caller.
  cai_comm_work* Run(const cai_comm_args& args);
  // Returns the operation's outcome (throws its error). timeout 0 waits for the end of the
  // operation, which its own timeout bounds; a shorter wait that runs out throws
  // DEADLINE_EXCEEDED and leaves the operation running.
  static void Wait(cai_comm_work* work, std::chrono::milliseconds timeout);
  static bool IsCompleted(cai_comm_work* work);
  // Waits for the operation if it is still running, then frees the handle. Accepts nullptr.
  static void Release(cai_comm_work* work);
  // Run + Wait + Release, for synchronous callers.
  void RunSync(const cai_comm_args& args);
  // The host's own small collectives on the world group, synchronous: a barrier, one value
  // reduced over the ranks, and every rank's vector (all the same length) end to end.
  void Barrier();
  double AllReduce(double value, cai_reduce_op op);
  std::vector<int64_t> AllGather(std::span<const int64_t> mine);

  // Counters since Init or the last ResetCounters, for `group` or (nullptr) for all groups,
  // destroyed ones included.
  cai_comm_counters Counters(const cai_comm_group* group) const;
  // Wire bytes (see WireCounters) since Init or the last ResetCounters, for `group` or
  // (nullptr) for all groups, destroyed ones included. Host-side only: not in the ABI.
  WireCounters WireBytes(const cai_comm_group* group) const;
  // Resets both the bytes handed and the wire bytes.
  void ResetCounters();
  // Whether the group's (nullptr: the world's) all_reduce, reduce_scatter and all_gather of
  // host memory go through shared memory (CommOptions::shared_memory).
  bool SharedMemory(const cai_comm_group* group) const;
  // Why they do not ("launch.comm_transport = \"tcp\"", "rank 1 could not create its
  // outbox", ...); empty when they do.
  std::string WhyNotSharedMemory(const cai_comm_group* group) const;
  // What each collective maps to on this group's backend. Static storage.
  const char* BackendInfo(const cai_comm_group* group) const;
  // The local address the collectives bind to and why: "10.1.2.3 (interface eth1 from
  // CAI_SOCKET_IFNAME)".
  const std::string& BindAddress() const;

  class Impl;

 private:
  explicit Communicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

const char* CommOpName(cai_comm_op op);

}  // namespace cai
