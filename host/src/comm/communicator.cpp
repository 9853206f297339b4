// Backend map (also returned by backend_info):
//
// Gloo, CPU tensors — every collective at its own byte cost, on libgloo alone:
//   all_reduce      gloo::allreduce, ring (reduce-scatter + all-gather, 2(n-1)/n of the tensor
//                   sent per rank); custom reduction functions give every dtype and op,
//                   bf16/fp16 reduced in fp32 and rounded per step; avg = sum / n.
//   reduce_scatter  our ring on Gloo's unbound buffers (gloo_ops.cpp): (n-1)/n of the input;
//                   avg = sum / n.
//   all_gather      our ring on Gloo's unbound buffers, each segment forwarded as soon as it
//                   arrives: (n-1)/n of the output.
//   lanes           all_reduce, reduce_scatter and all_gather of >= 1 MiB per lane are split
//                   over CommOptions::lanes contexts, each on a Gloo device (one I/O thread) of
//                   its own, each lane on its own thread moving a contiguous share of every
//                   chunk: Gloo serves all of a device's connections on one thread, which then
//                   sends and receives in turn (bench/README.md has the figures).
//   shared memory   when every rank of a group maps its neighbours' outboxes (one host;
//                   CommOptions::shared_memory), all_reduce, reduce_scatter and all_gather of
//                   host memory take comm/shm_ring.h's ring instead: the same rings, through
//                   slots in /dev/shm rather than sockets; a wait on a neighbour polls the
//                   neighbour's Gloo connection, so a dead peer fails it as it would over TCP.
//   broadcast       gloo::broadcast, a binomial tree from the root (on 2 and 3 ranks the root
//                   sends every copy).
//   reduce          gloo::reduce: ring reduce-scatter, then the chunks gathered at the root;
//                   avg = sum / n on the root. The ring sends all but two of its segments (1
//                   MiB at most, at least 2 per rank): (n-1)/n of the tensor up to 2n MiB, close
//                   to all of it beyond (12 MiB on 2 ranks: 10 MiB, not 6), as the wire counters
//                   show. No strategy reduces to a root today.
//   all_to_all      gloo::alltoall, pairwise exchange.
//   send / recv     Gloo unbound buffers on a slot derived from the tag.
//   barrier         gloo::barrier.
// NCCL, CUDA tensors (libcai_cuda.so, see cuda/module.cpp; loaded on the first CUDA tensor):
//   ncclAllReduce, ncclReduceScatter, ncclAllGather, ncclBroadcast, ncclReduce, grouped
//   ncclSend/ncclRecv for all_to_all, ncclSend/ncclRecv; ncclAvg for avg. One NCCL
//   communicator per group and device, created on the group's first CUDA collective (as c10d's
//   ProcessGroupNCCL does). These are enqueued on args.stream by the calling thread; their
//   work handles are complete on return, meaning "ordered on the stream", not "done".
//
// Why not c10d's ProcessGroupGloo: in LibTorch 1.13 it has no reduce_scatter or
// _allgather_base and cannot all-reduce bf16, so ZeRO would pay an all-reduce (twice the
// bytes) for every reduce-scatter. Only c10d's TCPStore is used, for the rendezvous. Debian's
// libtorch_cpu links the system libgloo.so.0 instead of bundling Gloo (nm -D exports no gloo::
// definitions), so there is one copy of Gloo in the process; an upstream LibTorch that bundles
// and exports Gloo must be paired with Gloo headers of the same commit.
//
// Threads: each group has a worker that runs its operations in issue order (so they overlap
// with the caller's compute) and a point-to-point waiter, so that a posted send does not hold
// up the receive queued after it (Gloo moves the data only once both sides have posted). A
// reporter thread publishes, per group, the last collective each rank started; a rank whose
// collective times out reads it back to name the ranks that never arrived. The liveness
// monitor's thread (comm/liveness.h) sends heartbeats and watches the peers'.
//
// The call check runs on a Gloo context of its own per group (check_context), so that its
// bytes never mix with the wire counts of the group's lanes.
//
// Byte counters: bytes handed to each operation are counted when it is issued, from its
// arguments (the ABI's counters); bytes on the wire are measured from the kernel's TCP counters
// of the group's connections when it completes (WireCounters in communicator.h), plus what a
// shared-memory collective wrote into its outbox. NCCL's are not measurable from the host.
#include "comm/communicator.h"

#include <arpa/inet.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "comm/gloo_ops.h"
#include "comm/liveness.h"
#include "comm/shm_ring.h"
#include "comm/store.h"
#include "comm/tcp_bytes_sent.h"
#include "core/status.h"
#include "cuda/cuda_module.h"

using cai::comm::Buffer;
using cai::comm::DType;
using cai::comm::OpSpec;

namespace {

// Per operation kind: calls and bytes handed (counted at issue), wire bytes (counted at
// completion; cai::WireCounters says what they are).
struct Counters {
  std::array<std::atomic<uint64_t>, CAI_COMM_NUM_OPS> calls{};
  std::array<std::atomic<uint64_t>, CAI_COMM_NUM_OPS> bytes{};
  std::array<std::atomic<uint64_t>, CAI_COMM_NUM_OPS> wire{};
  std::array<std::atomic<uint64_t>, CAI_COMM_NUM_OPS> unmeasured{};
  void Add(cai_comm_op op, uint64_t n) {
    calls[op].fetch_add(1, std::memory_order_relaxed);
    bytes[op].fetch_add(n, std::memory_order_relaxed);
  }
  // `n` bytes measured on the wire, or none (nullopt) where they cannot be measured.
  void AddWire(cai_comm_op op, std::optional<uint64_t> n) {
    if (n) {
      wire[op].fetch_add(*n, std::memory_order_relaxed);
    } else {
      unmeasured[op].fetch_add(1, std::memory_order_relaxed);
    }
  }
  void Reset() {
    for (auto* counts : {&calls, &bytes, &wire, &unmeasured}) {
      for (auto& c : *counts) c.store(0, std::memory_order_relaxed);
    }
  }
  void CopyTo(cai_comm_counters& out) const {
    for (int i = 0; i < CAI_COMM_NUM_OPS; ++i) {
      out.calls[i] = calls[i].load(std::memory_order_relaxed);
      out.bytes[i] = bytes[i].load(std::memory_order_relaxed);
    }
  }
  void CopyTo(cai::WireCounters& out) const {
    for (int i = 0; i < CAI_COMM_NUM_OPS; ++i) {
      out.bytes[i] = wire[i].load(std::memory_order_relaxed);
      out.unmeasured_calls[i] = unmeasured[i].load(std::memory_order_relaxed);
    }
  }
};

// How all_reduce, reduce_scatter and all_gather travel over TCP.
std::string TcpRingsInfo(int lanes) {
  return "all_reduce=gloo::allreduce ring, custom reductions for every dtype/op, bf16/fp16 "
         "reduced in fp32, avg=sum then divided by n (reduce: on the root); "
         "reduce_scatter=ring on gloo unbound buffers, (n-1)/n of the input per rank; "
         "all_gather=ring on gloo unbound buffers, (n-1)/n of the output per rank; "
         "all_reduce, reduce_scatter and all_gather from 1 MiB per lane split over " +
         std::to_string(lanes) + " lane(s), each with its own connections and I/O thread";
}

// ... and through shared memory (comm/shm_ring.h).
constexpr const char* kShmRingsInfo =
    "all_reduce=ring through shared memory (every rank of the group on this host): a "
    "reduce-scatter then an all-gather, segment by segment, bf16/fp16 reduced in fp32, avg=sum "
    "then divided by n; reduce_scatter=ring through shared memory, each step reduced straight "
    "into the outbox, (n-1)/n of the input per rank; all_gather=ring through shared memory, "
    "(n-1)/n of the output per rank";

std::string GlooBackendInfo(const std::string& rings) {
  return "gloo (libgloo, TCP): " + rings +
         "; broadcast=gloo::broadcast; reduce=gloo::reduce (ring reduce-scatter + gather to "
         "root); all_to_all=gloo::alltoall; send/recv=gloo unbound buffers; "
         "barrier=gloo::barrier";
}

}  // namespace

// An operation in flight. Shared by the caller's handle and the group's threads.
struct WorkState {
  OpSpec spec;
  std::string description;  // "all_reduce #3 on group 'world' (rank 0 of 3)"
  std::string call;         // collectives only: "all_reduce #3 on group 'world'"
  uint64_t seq = 0;         // collectives only: 1-based position in the group's order

  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  cai_status_code code = CAI_OK;
  std::string message;

  void Finish(cai_status_code c, std::string m) {
    {
      std::lock_guard<std::mutex> lock(mu);
      done = true;
      code = c;
      message = std::move(m);
    }
    cv.notify_all();
  }
};

struct cai_comm_work {
  std::shared_ptr<WorkState> state;
};

struct cai_comm_group {
  cai::Communicator::Impl* owner = nullptr;
  int id = 0;
  std::string name;
  std::vector<int> world_ranks;
  int rank = 0;
  int size = 0;
  std::chrono::milliseconds timeout{0};
  std::shared_ptr<gloo::Context> context;
  // The collectives' contexts: `context` first, then one per extra lane (comm::RunCollective).
  std::vector<std::shared_ptr<gloo::Context>> lane_contexts;
  std::vector<gloo::Context*> lanes;
  std::shared_ptr<gloo::Context> check_context;  // the call check's; null when it is off
  // all_reduce, reduce_scatter and all_gather through shared memory when every rank of the
  // group could map its neighbour's outbox (comm/shm_ring.h); null: over the lanes.
  std::unique_ptr<cai::comm::ShmRing> shm;
  std::string shm_why_not;   // why `shm` is null; empty when it is not
  uint64_t shm_seen = 0;     // shm->BytesSent() at the last attribution; guarded by wire_mu
  std::string backend_info;  // BackendInfo(group)
  // What Gloo's errors may call each rank's connections (comm::AddPeerEndpoints).
  std::vector<std::vector<std::string>> peer_endpoints;
  Counters counters;
  // Wire accounting (cai::WireCounters); guarded by wire_mu. `sent` is null where the kernel
  // cannot tell.
  std::unique_ptr<cai::comm::TcpBytesSent> sent;
  std::mutex wire_mu;
  uint64_t wire_seen = 0;   // sent->Read() at the last attribution
  uint64_t wire_carry = 0;  // sent outside collectives, owed to the next send/recv to complete
  bool in_collective = false;
  // NCCL communicators by CUDA device, made on first use; guarded by device_mu.
  std::mutex device_mu;
  std::map<int, std::unique_ptr<cai::cuda::Collectives>> device_collectives;

  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<WorkState>> queue;
  // Posted sends and receives, each waited for in posting order by a thread of its own: a
  // receive completes as soon as its data is in, never behind a send still waiting for its
  // peer's receive (a zero-bubble pipeline sends ahead of what its peer receives next).
  using PostedP2P =
      std::pair<std::shared_ptr<WorkState>, std::unique_ptr<gloo::transport::UnboundBuffer>>;
  std::array<std::deque<PostedP2P>, 2> p2p;  // [0] receives, [1] sends
  std::condition_variable p2p_cv;
  bool stopping = false;
  uint64_t issued = 0;  // collectives issued so far
  std::string broken;   // why the group cannot be used any more; empty while healthy
  std::string running;  // the collective the worker is in (WorkState::call), or empty
  std::chrono::steady_clock::time_point running_since;
  std::string last_done;  // the last collective the worker finished
  std::thread worker;
  std::array<std::thread, 2> p2p_waiters;  // as p2p

  std::string RankName(int group_rank) const {
    if (name == "world") return "rank " + std::to_string(group_rank);
    return "rank " + std::to_string(group_rank) + " (world rank " +
           std::to_string(world_ranks[group_rank]) + ")";
  }
};

namespace cai {

namespace {

std::mutex g_instance_mu;
std::unique_ptr<Communicator> g_instance;

// The last collective each rank of each group started, published through the store so that a
// rank whose collective times out can tell which peers never reached it.
class ProgressBoard {
 public:
  explicit ProgressBoard(std::unique_ptr<comm::Store> store)
      : store_(std::move(store)), thread_([this] { Loop(); }) {}
  ~ProgressBoard() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  static std::string Key(int group_id, int group_rank) {
    return "cai/progress/" + std::to_string(group_id) + "/" + std::to_string(group_rank);
  }

  void Started(int group_id, int group_rank, uint64_t seq) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      dirty_[Key(group_id, group_rank)] = seq;
    }
    cv_.notify_one();
  }

  // The last collective `group_rank` of `group` started (0: none), or nullopt when the store
  // cannot be read.
  std::optional<uint64_t> LastStarted(const cai_comm_group& group, int group_rank) {
    try {
      const auto value = store_->TryGet(Key(group.id, group_rank));
      return value ? std::stoull(*value) : 0;
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }

  // For each peer of `group` that has not started collective `seq`, a phrase naming it;
  // nullopt when the store cannot be read (rank 0, which serves it, has gone).
  std::optional<std::vector<std::string>> Laggards(const cai_comm_group& group, uint64_t seq) {
    std::vector<std::string> out;
    for (int r = 0; r < group.size; ++r) {
      if (r == group.rank) continue;
      std::optional<std::string> value;
      try {
        value = store_->TryGet(Key(group.id, r));
      } catch (const std::exception&) {
        return std::nullopt;
      }
      const uint64_t last = value ? std::stoull(*value) : 0;
      if (last >= seq) continue;
      out.push_back(group.RankName(r) + (last == 0
                                             ? " has not started any collective"
                                             : " is still at collective #" + std::to_string(last)));
    }
    return out;
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      cv_.wait(lock, [&] { return stop_ || !dirty_.empty(); });
      auto batch = std::exchange(dirty_, {});
      lock.unlock();
      for (const auto& [key, seq] : batch) {
        try {
          store_->SetString(key, std::to_string(seq));
        } catch (const std::exception&) {
          // Rank 0 (the store) may have shut down first; progress is only diagnostics.
        }
      }
      lock.lock();
      // At most ~100 writes a second per rank: progress is read only after a timeout.
      cv_.wait_for(lock, std::chrono::milliseconds(10), [&] { return stop_; });
    }
  }

  std::unique_ptr<comm::Store> store_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, uint64_t> dirty_;
  bool stop_ = false;
  std::thread thread_;
};

// The IPv4 address of network interface `name`; `source` says where the name came from.
std::string InterfaceAddress(const std::string& name, const std::string& source) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0) {
    throw Error(CAI_UNAVAILABLE, "cannot list the network interfaces (getifaddrs) to find '" +
                                     name + "' (" + source + ")");
  }
  std::string found;
  std::string available;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || a->ifa_addr->sa_family != AF_INET) continue;
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr, text, sizeof(text));
    if (name == a->ifa_name && found.empty()) found = text;
    available += (available.empty() ? "" : ", ") + std::string(a->ifa_name) + " " + text;
  }
  freeifaddrs(list);
  if (found.empty()) {
    throw Error(CAI_INVALID_ARGUMENT,
                "network interface '" + name + "' (" + source +
                    ") does not exist or has no IPv4 address; interfaces here: " +
                    (available.empty() ? "none" : available) +
                    ". Name one of them, or unset it to bind to the route to master_addr");
  }
  return found;
}

// The local address the collectives bind to, and why ("interface eth1 from CAI_SOCKET_IFNAME").
struct BindChoice {
  std::string address;
  std::string why;
};

BindChoice ResolveBindAddress(const CommOptions& options) {
  if (!options.bind_addr.empty()) return {options.bind_addr, "given"};
  if (!options.socket_ifname.empty()) {
    return {InterfaceAddress(options.socket_ifname, "launch.socket_ifname"),
            "interface " + options.socket_ifname + " from launch.socket_ifname"};
  }
  for (const char* var : {"CAI_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}) {
    const char* value = std::getenv(var);
    if (value == nullptr || *value == '\0') continue;
    // GLOO_SOCKET_IFNAME may list several (c10d spreads connections over them): the first.
    const std::string text = value;
    const std::string name = text.substr(0, text.find(','));
    return {InterfaceAddress(name, var), "interface " + name + " from " + var};
  }
  in_addr master{};
  if (options.master_addr == "localhost" ||
      (inet_pton(AF_INET, options.master_addr.c_str(), &master) == 1 &&
       (ntohl(master.s_addr) >> 24) == 127)) {
    return {"127.0.0.1", "loopback, as master_addr is"};
  }
  // The address this host would use to reach the master: connect() on a UDP socket picks the
  // route without sending anything.
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(static_cast<uint16_t>(options.master_port));
  dst.sin_addr = master;
  sockaddr_in local{};
  socklen_t len = sizeof(local);
  char text[INET_ADDRSTRLEN] = {};
  const bool ok = fd >= 0 && inet_pton(AF_INET, options.master_addr.c_str(), &master) == 1 &&
                  connect(fd, reinterpret_cast<sockaddr*>(&dst), sizeof(dst)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
                  inet_ntop(AF_INET, &local.sin_addr, text, sizeof(text)) != nullptr;
  if (fd >= 0) close(fd);
  if (!ok) {
    throw Error(CAI_INVALID_ARGUMENT,
                "cannot choose a local address to reach master_addr '" + options.master_addr +
                    "'; give an IPv4 master address or set the bind address explicitly");
  }
  return {text, "the route to master_addr " + options.master_addr};
}

DType ToDType(const cai_dtype& d, const std::string& where) {
  if (d.lanes == 1) {
    if (d.code == CAI_DTYPE_FLOAT && d.bits == 32) return DType::kF32;
    if (d.code == CAI_DTYPE_FLOAT && d.bits == 64) return DType::kF64;
    if (d.code == CAI_DTYPE_FLOAT && d.bits == 16) return DType::kF16;
    if (d.code == CAI_DTYPE_BFLOAT && d.bits == 16) return DType::kBF16;
    if (d.code == CAI_DTYPE_INT && d.bits == 32) return DType::kI32;
    if (d.code == CAI_DTYPE_INT && d.bits == 64) return DType::kI64;
    if (d.code == CAI_DTYPE_UINT && d.bits == 8) return DType::kU8;
  }
  throw Error(CAI_INVALID_ARGUMENT,
              where + " has dtype {code " + std::to_string(d.code) + ", bits " +
                  std::to_string(d.bits) + ", lanes " + std::to_string(d.lanes) +
                  "}; the communicator takes fp32, fp64, bf16, fp16, int32, int64 and uint8");
}

Buffer ToBuffer(const cai_tensor* t, const std::string& where) {
  if (t == nullptr) throw Error(CAI_INVALID_ARGUMENT, where + " is NULL");
  Buffer b;
  b.dtype = ToDType(t->dtype, where);
  if (t->device.device_type == CAI_DEVICE_CUDA) {
    b.cuda_device = t->device.device_id;
  } else if (t->device.device_type != CAI_DEVICE_CPU &&
             t->device.device_type != CAI_DEVICE_CUDA_HOST) {
    throw Error(CAI_UNIMPLEMENTED,
                where + " is on device type " + std::to_string(t->device.device_type) +
                    "; the communicator takes host memory (Gloo) and CUDA memory (NCCL)");
  }
  if (t->ndim < 0 || (t->ndim > 0 && (t->shape == nullptr || t->strides == nullptr))) {
    throw Error(CAI_INVALID_ARGUMENT,
                where + " has ndim " + std::to_string(t->ndim) + " but no shape or strides");
  }
  int64_t numel = 1;
  int64_t expected_stride = 1;
  for (int d = t->ndim - 1; d >= 0; --d) {
    if (t->shape[d] < 0) {
      throw Error(CAI_INVALID_ARGUMENT,
                  where + " has a negative extent in dimension " + std::to_string(d));
    }
    if (t->shape[d] != 1 && t->strides[d] != expected_stride) {
      throw Error(CAI_INVALID_ARGUMENT, where + " is not contiguous (dimension " +
                                            std::to_string(d) + " has stride " +
                                            std::to_string(t->strides[d]) + ", expected " +
                                            std::to_string(expected_stride) + ")");
    }
    expected_stride *= t->shape[d];
    numel *= t->shape[d];
  }
  if (t->data == nullptr && numel > 0) {
    throw Error(CAI_INVALID_ARGUMENT,
                where + " has " + std::to_string(numel) + " elements but a NULL data pointer");
  }
  b.numel = static_cast<size_t>(numel);
  b.data = static_cast<std::byte*>(t->data) + t->byte_offset;
  return b;
}

std::string Numel(const Buffer& b) { return std::to_string(b.numel); }

}  // namespace

const char* CommOpName(cai_comm_op op) {
  static constexpr const char* kNames[CAI_COMM_NUM_OPS] = {
      "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce",
      "all_to_all", "send",           "recv",       "barrier"};
  return op >= 0 && op < CAI_COMM_NUM_OPS ? kNames[op] : "unknown_op";
}

class Communicator::Impl {
 public:
  bool shared_memory(const cai_comm_group* group) const {
    if (group == nullptr) group = world_;
    return group != nullptr && group->shm != nullptr;
  }

  std::string why_not_shared_memory(const cai_comm_group* group) const {
    if (group == nullptr) group = world_;
    return group != nullptr ? group->shm_why_not : "no world group";
  }

  const char* backend_info(const cai_comm_group* group) const {
    if (group == nullptr) group = world_;
    return group != nullptr ? group->backend_info.c_str() : backend_info_.c_str();
  }

  explicit Impl(const CommOptions& options) : options_(options) {
    if (options.world_size < 1 || options.rank < 0 || options.rank >= options.world_size) {
      throw Error(CAI_INVALID_ARGUMENT, "communicator: rank " + std::to_string(options.rank) +
                                            " is not within world size " +
                                            std::to_string(options.world_size));
    }
    if (options.timeout.count() <= 0) {
      throw Error(CAI_INVALID_ARGUMENT, "communicator: the timeout must be positive");
    }
    store_ = std::make_unique<comm::Store>(options.master_addr, options.master_port,
                                           options.rank == 0, options.timeout);
    progress_ = std::make_unique<ProgressBoard>(std::make_unique<comm::Store>(
        options.master_addr, options.master_port, false, options.timeout));
    gloo::transport::tcp::attr attr;
    const BindChoice bind = ResolveBindAddress(options);
    attr.hostname = bind.address;
    bind_description_ = bind.address + " (" + bind.why + ")";
    if (options.lanes < 1) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "communicator: lanes must be at least 1, not " + std::to_string(options.lanes));
    }
    // A device per lane: each has its own I/O thread (Gloo serves all of a device's
    // connections on one), which is what lets the lanes' transfers run at once.
    for (int lane = 0; lane < options.lanes; ++lane) {
      devices_.push_back(gloo::transport::tcp::CreateDevice(attr));
    }
    backend_info_ = GlooBackendInfo(TcpRingsInfo(options.lanes));
    if (options.heartbeat_timeout.count() > 0 && options.world_size > 1) {
      comm::LivenessOptions lo;
      lo.rank = options.rank;
      lo.world_size = options.world_size;
      lo.limit = options.heartbeat_timeout;
      // Ten beats within the limit: a peer is declared lost after missing many, never one.
      lo.interval = std::min(std::chrono::milliseconds(500), options.heartbeat_timeout / 10);
      lo.bind_address = bind.address;
      // Before the world's rendezvous, which then guarantees every rank's address is published.
      liveness_ = std::make_unique<comm::Liveness>(
          *store_, lo, [this] { return Activity(); },
          [this](const std::string& report) {
            Abort(report);
            if (options_.on_peer_failure) options_.on_peer_failure(report);
          });
    }
    std::vector<int32_t> all(options.world_size);
    for (int i = 0; i < options.world_size; ++i) all[i] = i;
    world_ = CreateGroup(all, "world");
    if (liveness_) liveness_->Start(*store_);
  }

  ~Impl() {
    // First: the ranks watching this one stop, before its connections close.
    if (liveness_) liveness_->Leave();
    std::vector<cai_comm_group*> groups;
    {
      std::lock_guard<std::mutex> lock(mu_);
      groups.assign(groups_.begin(), groups_.end());
    }
    for (auto* g : groups) DestroyGroup(g);
  }

  const CommOptions& options() const { return options_; }
  const std::string& bind_description() const { return bind_description_; }
  cai_comm_group* world() const { return world_; }

  cai_comm_group* Group(const cai_comm_group* group) const {
    return group ? const_cast<cai_comm_group*>(group) : world_;
  }

  cai_comm_group* NewGroup(std::span<const int32_t> ranks) {
    if (ranks.empty()) throw Error(CAI_INVALID_ARGUMENT, "new_group: the rank list is empty");
    std::set<int32_t> seen;
    for (int32_t r : ranks) {
      if (r < 0 || r >= options_.world_size) {
        throw Error(CAI_INVALID_ARGUMENT, "new_group: rank " + std::to_string(r) +
                                              " is outside the world of " +
                                              std::to_string(options_.world_size));
      }
      if (!seen.insert(r).second) {
        throw Error(CAI_INVALID_ARGUMENT,
                    "new_group: rank " + std::to_string(r) + " is listed twice");
      }
    }
    std::string name;
    for (int32_t r : ranks) name += (name.empty() ? "" : ",") + std::to_string(r);
    return CreateGroup(ranks, "group " + std::to_string(next_group_id_.load()) + " [" + name + "]");
  }

  void DestroyGroup(cai_comm_group* g) {
    if (g == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!groups_.erase(g)) return;
    }
    {
      std::lock_guard<std::mutex> lock(g->mu);
      g->stopping = true;
    }
    g->cv.notify_all();
    g->p2p_cv.notify_all();
    g->worker.join();
    for (std::thread& t : g->p2p_waiters) t.join();
    delete g;
  }

  cai_comm_work* Run(const cai_comm_args& args) {
    RequireStructSize(&args, CAI_STRUCT_SIZE(cai_comm_args, stream), "cai_comm_args");
    if (args.op < 0 || args.op >= CAI_COMM_NUM_OPS) {
      throw Error(CAI_INVALID_ARGUMENT, "run: unknown cai_comm_op " + std::to_string(args.op));
    }
    cai_comm_group* g = Group(args.group);
    auto work = std::make_shared<WorkState>();
    OpSpec& spec = work->spec;
    spec.op = args.op;
    spec.reduce = args.reduce_op;
    spec.root = args.root;
    spec.peer = args.peer;
    spec.timeout = args.timeout_ms > 0 ? std::chrono::milliseconds(args.timeout_ms) : g->timeout;
    const std::string op = CommOpName(args.op);
    const std::string where = op + " on group '" + g->name + "'";
    if (args.timeout_ms < 0) {
      throw Error(CAI_INVALID_ARGUMENT, where + ": timeout_ms is negative");
    }
    if (args.tag < 0) throw Error(CAI_INVALID_ARGUMENT, where + ": tag is negative");
    spec.tag = static_cast<uint32_t>(args.tag);
    const size_t n = static_cast<size_t>(g->size);
    auto check_root = [&] {
      if (args.root < 0 || args.root >= g->size) {
        throw Error(CAI_INVALID_ARGUMENT, where + ": root " + std::to_string(args.root) +
                                              " is not a rank of this " + std::to_string(g->size) +
                                              "-rank group");
      }
    };
    auto check_reduce = [&] {
      if (args.reduce_op < CAI_REDUCE_SUM || args.reduce_op > CAI_REDUCE_PRODUCT) {
        throw Error(CAI_INVALID_ARGUMENT,
                    where + ": unknown cai_reduce_op " + std::to_string(args.reduce_op));
      }
    };
    auto both = [&] {
      spec.input = ToBuffer(args.input, where + ": input");
      spec.output = ToBuffer(args.output, where + ": output");
      if (spec.input.dtype != spec.output.dtype) {
        throw Error(CAI_INVALID_ARGUMENT,
                    where + ": input is " + comm::DTypeName(spec.input.dtype) + " but output is " +
                        comm::DTypeName(spec.output.dtype));
      }
    };
    uint64_t counted = 0;
    switch (args.op) {
      case CAI_COMM_ALL_REDUCE:
        check_reduce();
        spec.output = ToBuffer(args.output, where + ": output");
        counted = spec.output.bytes();
        break;
      case CAI_COMM_REDUCE_SCATTER:
        check_reduce();
        both();
        if (spec.input.numel != n * spec.output.numel) {
          throw Error(CAI_INVALID_ARGUMENT, where + ": input has " + Numel(spec.input) +
                                                " elements, expected group size " +
                                                std::to_string(n) + " x output's " +
                                                Numel(spec.output));
        }
        counted = spec.input.bytes();
        break;
      case CAI_COMM_ALL_GATHER:
        both();
        if (spec.output.numel != n * spec.input.numel) {
          throw Error(CAI_INVALID_ARGUMENT, where + ": output has " + Numel(spec.output) +
                                                " elements, expected group size " +
                                                std::to_string(n) + " x input's " +
                                                Numel(spec.input));
        }
        counted = spec.input.bytes();
        break;
      case CAI_COMM_BROADCAST:
        check_root();
        spec.output = ToBuffer(args.output, where + ": output");
        counted = spec.output.bytes();
        break;
      case CAI_COMM_REDUCE:
        check_root();
        check_reduce();
        spec.output = ToBuffer(args.output, where + ": output");
        counted = spec.output.bytes();
        break;
      case CAI_COMM_ALL_TO_ALL:
        both();
        if (spec.input.numel != spec.output.numel || spec.input.numel % n != 0) {
          throw Error(CAI_INVALID_ARGUMENT, where + ": input (" + Numel(spec.input) +
                                                " elements) and output (" + Numel(spec.output) +
                                                ") must be equal and divisible by the group "
                                                "size " +
                                                std::to_string(n));
        }
        counted = spec.input.bytes();
        break;
      case CAI_COMM_SEND:
      case CAI_COMM_RECV:
        if (args.peer < 0 || args.peer >= g->size || args.peer == g->rank) {
          throw Error(CAI_INVALID_ARGUMENT, where + ": peer " + std::to_string(args.peer) +
                                                " is not another rank of this " +
                                                std::to_string(g->size) + "-rank group");
        }
        if (args.op == CAI_COMM_SEND) {
          spec.input = ToBuffer(args.input, where + ": input");
          counted = spec.input.bytes();
        } else {
          spec.output = ToBuffer(args.output, where + ": output");
          counted = spec.output.bytes();
        }
        break;
      case CAI_COMM_BARRIER:
        break;
    }
    if (const int device = CudaDevice(spec, where); device >= 0) {
      return RunOnDevice(*g, spec, work, device, counted, args.stream);
    }
    {
      std::lock_guard<std::mutex> lock(g->mu);
      if (args.op == CAI_COMM_SEND || args.op == CAI_COMM_RECV) {
        work->description = op + (args.op == CAI_COMM_SEND ? " to " : " from ") +
                            g->RankName(args.peer) + " (tag " + std::to_string(args.tag) +
                            ") on group '" + g->name + "'";
      } else {
        work->seq = ++g->issued;
        work->call = op + " #" + std::to_string(work->seq) + " on group '" + g->name + "'";
        work->description = work->call;
      }
      work->description += " (" + g->RankName(g->rank) + " of " + std::to_string(g->size) + ")";
      g->queue.push_back(work);
    }
    g->counters.Add(args.op, counted);
    totals_.Add(args.op, counted);
    g->cv.notify_one();
    return new cai_comm_work{std::move(work)};
  }

  // The CUDA device of the operation's buffers, -1 when they are in host memory; refuses a
  // mix, which neither backend could run.
  static int CudaDevice(const OpSpec& spec, const std::string& where) {
    const bool in = spec.input.data != nullptr || spec.input.numel > 0;
    const bool out = spec.output.data != nullptr || spec.output.numel > 0;
    if (in && out && spec.input.cuda_device != spec.output.cuda_device) {
      auto name = [](int d) {
        return d < 0 ? std::string("host memory") : "CUDA device " + std::to_string(d);
      };
      throw Error(CAI_INVALID_ARGUMENT, where + ": input is in " + name(spec.input.cuda_device) +
                                            " but output is in " + name(spec.output.cuda_device));
    }
    return out ? spec.output.cuda_device : in ? spec.input.cuda_device : -1;
  }

  class StoreKeyValue final : public cuda::KeyValue {
   public:
    explicit StoreKeyValue(comm::Store& store) : store_(store) {}
    void Set(const std::string& key, const std::vector<char>& value) override {
      store_.set(key, value);
    }
    std::vector<char> Get(const std::string& key, std::chrono::milliseconds timeout) override {
      store_.wait({key}, timeout);
      return store_.get(key);
    }

   private:
    comm::Store& store_;
  };

  cai_comm_work* RunOnDevice(cai_comm_group& g, const OpSpec& spec,
                             const std::shared_ptr<WorkState>& work, int device, uint64_t counted,
                             void* stream) {
    const std::string where = std::string(CommOpName(spec.op)) + " on group '" + g.name + "' (" +
                              g.RankName(g.rank) + ") with CUDA tensors";
    cuda::DeviceOp op;
    op.op = spec.op;
    op.reduce = spec.reduce;
    op.input = spec.input.data;
    op.output = spec.output.data;
    op.dtype = comm::ToCaiDType(spec.op == CAI_COMM_SEND ? spec.input.dtype : spec.output.dtype);
    op.root = spec.root;
    op.peer = spec.peer;
    const size_t n = static_cast<size_t>(g.size);
    switch (spec.op) {
      case CAI_COMM_ALL_GATHER:
      case CAI_COMM_SEND:
        op.count = spec.input.numel;
        break;
      case CAI_COMM_ALL_TO_ALL:
        op.count = spec.input.numel / n;
        break;
      default:
        op.count = spec.output.numel;
    }
    std::lock_guard<std::mutex> lock(g.device_mu);
    try {
      cuda::Module& module = cuda::Load();
      auto& collectives = g.device_collectives[device];
      if (!collectives) {
        StoreKeyValue kv(*store_);
        collectives = module.NewCollectives(
            kv, "group-" + std::to_string(g.id) + "-device-" + std::to_string(device), g.rank,
            g.size, device, g.timeout);
      }
      collectives->Run(op, stream);
    } catch (const Error& e) {
      g.device_collectives.erase(device);  // never half-made; a failed NCCL call may break it
      throw Error(e.code(), where + ": " + e.what());
    }
    g.counters.Add(spec.op, counted);
    totals_.Add(spec.op, counted);
    AddWire(g, spec.op, std::nullopt);  // NCCL's traffic is invisible to the host
    work->description = where;
    work->Finish(CAI_OK, "");
    return new cai_comm_work{work};
  }

  cai_comm_counters Counters(const cai_comm_group* group) const {
    cai_comm_counters out{};
    out.struct_size = CAI_COMM_COUNTERS_STRUCT_SIZE;
    (group ? group->counters : totals_).CopyTo(out);
    return out;
  }

  WireCounters WireBytes(const cai_comm_group* group) const {
    WireCounters out;
    (group ? group->counters : totals_).CopyTo(out);
    return out;
  }

  void ResetCounters() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto* g : groups_) g->counters.Reset();
    totals_.Reset();
  }

 private:
  cai_comm_group* CreateGroup(std::span<const int32_t> ranks, std::string name) {
    const int id = next_group_id_.fetch_add(1);
    auto it = std::find(ranks.begin(), ranks.end(), options_.rank);
    if (it == ranks.end()) return nullptr;
    auto g = std::make_unique<cai_comm_group>();
    g->owner = this;
    g->id = id;
    g->name = std::move(name);
    g->world_ranks.assign(ranks.begin(), ranks.end());
    g->rank = static_cast<int>(it - ranks.begin());
    g->size = static_cast<int>(ranks.size());
    g->timeout = options_.timeout;
    Join(*g);
    auto context = std::make_shared<gloo::rendezvous::Context>(g->rank, g->size);
    context->setTimeout(options_.timeout);
    gloo::rendezvous::PrefixStore prefix("cai/gloo/" + std::to_string(id), *store_);
    std::shared_ptr<gloo::rendezvous::Context> check;
    std::vector<std::shared_ptr<gloo::Context>> lanes{context};
    try {
      context->connectFullMesh(prefix, devices_[0]);
      for (size_t lane = 1; g->size > 1 && lane < devices_.size(); ++lane) {
        auto extra = std::make_shared<gloo::rendezvous::Context>(g->rank, g->size);
        extra->setTimeout(options_.timeout);
        gloo::rendezvous::PrefixStore lane_prefix(
            "cai/gloo/" + std::to_string(id) + "/lane" + std::to_string(lane), *store_);
        extra->connectFullMesh(lane_prefix, devices_[lane]);
        lanes.push_back(std::move(extra));
      }
      if (options_.check_calls && g->size > 1) {
        check = std::make_shared<gloo::rendezvous::Context>(g->rank, g->size);
        check->setTimeout(options_.timeout);
        gloo::rendezvous::PrefixStore check_prefix("cai/check/" + std::to_string(id), *store_);
        check->connectFullMesh(check_prefix, devices_[0]);
      }
      std::string why_not = g->size == 1              ? "a group of one rank"
                            : !options_.shared_memory ? "launch.comm_transport = \"tcp\""
                                                      : "";
      if (why_not.empty()) {
        const auto all_gather = [&](std::span<const int64_t> mine) {
          std::vector<int64_t> all(mine.size() * static_cast<size_t>(g->size));
          comm::AllGatherInt64(*context, mine.data(), all.data(), mine.size(), options_.timeout);
          return all;
        };
        g->shm = comm::ShmRing::Open(g->rank, g->size, all_gather, &why_not);
      }
      if (g->shm) why_not.clear();
      g->backend_info = GlooBackendInfo(g->shm         ? kShmRingsInfo
                                        : g->size == 1 ? TcpRingsInfo(options_.lanes)
                                                       : "not through shared memory (" + why_not +
                                                             "): " + TcpRingsInfo(options_.lanes));
      g->shm_why_not = std::move(why_not);
    } catch (const gloo::Exception& e) {
      throw Error(CAI_UNAVAILABLE, "connecting the ranks of group '" + g->name + "' failed on " +
                                       g->RankName(g->rank) + ": " + e.what());
    }
    g->check_context = std::move(check);
    for (const auto& lane : lanes) {
      comm::AddPeerEndpoints(*lane, g->peer_endpoints);
      g->lanes.push_back(lane.get());
    }
    if (g->check_context) comm::AddPeerEndpoints(*g->check_context, g->peer_endpoints);
    g->sent = comm::TcpBytesSent::Open(g->lanes);
    if (g->sent) g->wire_seen = g->sent->Read();  // the rendezvous's own bytes are no op's
    g->context = std::move(context);
    g->lane_contexts = std::move(lanes);
    cai_comm_group* raw = g.get();
    raw->worker = std::thread([this, raw] { WorkerLoop(*raw); });
    for (size_t sends = 0; sends < 2; ++sends) {
      raw->p2p_waiters[sends] = std::thread([this, raw, sends] { PointToPointLoop(*raw, sends); });
    }
    std::lock_guard<std::mutex> lock(mu_);
    groups_.insert(g.release());
    return raw;
  }

  // Every member announces itself, then waits for the others, so that a rank that never
  // comes is reported by name rather than as a Gloo connection timeout.
  void Join(cai_comm_group& g) {
    const std::string prefix = "cai/join/" + std::to_string(g.id) + "/";
    store_->SetString(prefix + std::to_string(g.rank), "1");
    std::vector<std::string> keys;
    for (int r = 0; r < g.size; ++r) keys.push_back(prefix + std::to_string(r));
    try {
      store_->wait(keys, options_.timeout);
    } catch (const Error&) {
      std::string missing;
      for (const auto& key : store_->Missing(keys)) {
        missing += (missing.empty() ? "" : ", ") + g.RankName(std::stoi(key.substr(prefix.size())));
      }
      throw Error(CAI_DEADLINE_EXCEEDED,
                  "rendezvous of group '" + g.name + "' at " + options_.master_addr + ":" +
                      std::to_string(options_.master_port) + " timed out after " +
                      std::to_string(options_.timeout.count()) + " ms on " + g.RankName(g.rank) +
                      ": " + missing + " did not join");
    }
  }

  static void Fail(cai_comm_group& g, WorkState& w, cai_status_code code,
                   const std::string& message) {
    {
      std::lock_guard<std::mutex> lock(g.mu);
      if (g.broken.empty()) g.broken = w.description + ": " + message;
    }
    w.Finish(code, w.description + ": " + message);
  }

  // Gloo reports everything as gloo::Exception; its message tells a timeout from a peer that
  // went away.
  static cai_status_code Classify(const std::string& what) {
    if (what.find("Timed out") != std::string::npos || what.find("imeout") != std::string::npos) {
      return CAI_DEADLINE_EXCEEDED;
    }
    if (what.find("closed") != std::string::npos || what.find("reset") != std::string::npos) {
      return CAI_UNAVAILABLE;
    }
    return CAI_INTERNAL;
  }

  // Wire attribution (cai::WireCounters): the worker brackets each collective with WireBegin
  // and WireEnd; bytes sent outside collectives wait in wire_carry for the next send or recv
  // to complete. Each is counted before its operation is reported complete, so a caller that
  // has waited for an operation reads counters that include it.
  static void WireBegin(cai_comm_group& g) {
    if (!g.sent) return;
    std::lock_guard<std::mutex> lock(g.wire_mu);
    const uint64_t now = g.sent->Read();
    g.wire_carry += now - g.wire_seen;
    g.wire_seen = now;
    g.in_collective = true;
  }

  // A collective through shared memory adds what it wrote into its outbox.
  void WireEnd(cai_comm_group& g, cai_comm_op op) {
    std::optional<uint64_t> bytes;
    if (g.sent || g.shm) {
      std::lock_guard<std::mutex> lock(g.wire_mu);
      bytes = 0;
      if (g.sent) {
        const uint64_t now = g.sent->Read();
        *bytes += now - g.wire_seen;
        g.wire_seen = now;
      }
      if (g.shm) {
        const uint64_t now = g.shm->BytesSent();
        *bytes += now - g.shm_seen;
        g.shm_seen = now;
      }
      g.in_collective = false;
    }
    AddWire(g, op, bytes);
  }

  void WirePointToPoint(cai_comm_group& g, cai_comm_op op) {
    std::optional<uint64_t> bytes;
    if (g.sent && op == CAI_COMM_RECV) {
      // A receive puts only its ready notification on the wire. What the counter shows when it
      // completes is the sends' (waited for on another thread), which their completion reads;
      // the notification's few bytes go to whatever reads the counter next.
      bytes = 0;
    } else if (g.sent) {
      std::lock_guard<std::mutex> lock(g.wire_mu);
      bytes = std::exchange(g.wire_carry, 0);
      if (!g.in_collective) {  // else what was sent since WireBegin is the collective's
        const uint64_t now = g.sent->Read();
        *bytes += now - g.wire_seen;
        g.wire_seen = now;
      }
    }
    AddWire(g, op, bytes);
  }

  void AddWire(cai_comm_group& g, cai_comm_op op, std::optional<uint64_t> bytes) {
    g.counters.AddWire(op, bytes);
    totals_.AddWire(op, bytes);
  }

  void WorkerLoop(cai_comm_group& g) {
    for (;;) {
      std::shared_ptr<WorkState> w;
      std::string broken;
      {
        std::unique_lock<std::mutex> lock(g.mu);
        g.cv.wait(lock, [&] { return g.stopping || !g.queue.empty(); });
        if (g.queue.empty()) return;
        w = std::move(g.queue.front());
        g.queue.pop_front();
        broken = g.broken;
      }
      if (!broken.empty()) {
        w->Finish(CAI_FAILED_PRECONDITION,
                  w->description + ": not run, the group failed earlier: " + broken);
        continue;
      }
      const OpSpec& spec = w->spec;
      if (spec.op == CAI_COMM_SEND || spec.op == CAI_COMM_RECV) {
        try {
          auto buffer = comm::PostPointToPoint(*g.context, spec);
          {
            std::lock_guard<std::mutex> lock(g.mu);
            g.p2p[spec.op == CAI_COMM_SEND].emplace_back(std::move(w), std::move(buffer));
          }
          g.p2p_cv.notify_all();
        } catch (const std::exception& e) {
          Fail(g, *w, Classify(e.what()), e.what());
        }
        continue;
      }
      progress_->Started(g.id, g.rank, w->seq);
      const auto start = std::chrono::steady_clock::now();
      {
        std::lock_guard<std::mutex> lock(g.mu);
        g.running = w->call;
        g.running_since = start;
      }
      WireBegin(g);
      try {
        // On connections of its own: its bytes are not on the ones WireEnd reads.
        if (g.check_context) CheckSameCall(g, *w);
        if (g.shm && comm::ShmRing::Runs(spec)) {
          g.shm->Run(spec, [&g] {
            // The ring's neighbours: a wait on one that died fails as its connection would.
            comm::ThrowIfPeerClosed(*g.context, (g.rank + g.size - 1) % g.size);
            comm::ThrowIfPeerClosed(*g.context, (g.rank + 1) % g.size);
          });
        } else {
          comm::RunCollective(g.lanes, spec);
        }
        WireEnd(g, spec.op);
        EndRunning(g, *w);
        w->Finish(CAI_OK, {});
      } catch (const Error& e) {  // the call check's verdict
        WireEnd(g, spec.op);
        EndRunning(g, *w);
        Fail(g, *w, e.code(), e.what());
      } catch (const std::exception& e) {
        WireEnd(g, spec.op);
        const cai_status_code code = Classify(e.what());
        // While this rank is still in the collective, for its heartbeat.
        if (code == CAI_UNAVAILABLE) ExplainClosed(g, *w, e.what());
        EndRunning(g, *w);
        if (std::string aborted = Aborted(); !aborted.empty()) {
          Fail(g, *w, CAI_UNAVAILABLE, aborted);
          continue;
        }
        std::string message = e.what();
        if (code == CAI_DEADLINE_EXCEEDED) {
          const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
              std::chrono::steady_clock::now() - start);
          message = "timed out after " + std::to_string(waited.count()) + " ms (timeout " +
                    std::to_string(spec.timeout.count()) + " ms)";
          const auto laggards = progress_->Laggards(g, w->seq);
          std::string named;
          for (const auto& l : laggards.value_or(std::vector<std::string>{})) {
            named += (named.empty() ? "" : "; ") + l;
          }
          message += !laggards ? "; which peer is missing is unknown: the rendezvous store on "
                                 "rank 0 no longer answers (rank 0 has left)"
                     : named.empty() ? "; every rank started it, so a peer stalled inside it"
                                     : "; " + named;
          message += " [gloo: " + std::string(e.what()) + "]";
        } else if (code == CAI_UNAVAILABLE) {
          message += ClosedBy(g, e.what());
        }
        Fail(g, *w, code, message);
      }
    }
  }

  // A peer closed its connection. A peer that aborted for a lost rank published why before
  // closing: wait for that report; without one the peer itself exited or was killed, and this
  // rank publishes that before it aborts, so that the ranks it leaves name the first loss.
  void ExplainClosed(const cai_comm_group& g, const WorkState& w, const std::string& what) {
    if (!liveness_ || liveness_->CheckVerdict()) return;
    const std::string closed = ClosedBy(g, what);
    if (closed.empty()) return;
    liveness_->Report(closed.substr(2) + " (noticed by world rank " +
                      std::to_string(options_.rank) + " in " + w.description + ")");
  }

  // For each peer whose connection Gloo's error `what` names: "; rank 2 closed its connection
  // (it exited or was killed); the last collective it started was #5".
  std::string ClosedBy(const cai_comm_group& g, const std::string& what) {
    std::string out;
    for (int r = 0; r < g.size; ++r) {
      const auto& names = g.peer_endpoints[static_cast<size_t>(r)];
      const bool named = std::any_of(names.begin(), names.end(), [&](const std::string& name) {
        return what.find(name + ":") != std::string::npos ||
               what.find(name + " ") != std::string::npos || what.ends_with(name);
      });
      if (!named) continue;
      out += "; " + g.RankName(r) + " closed its connection (it exited or was killed)";
      if (const auto last = progress_->LastStarted(g, r)) {
        out += *last == 0 ? "; it had not started any collective"
                          : "; the last collective it started was #" + std::to_string(*last);
      }
    }
    return out;
  }

  static void EndRunning(cai_comm_group& g, const WorkState& w) {
    std::lock_guard<std::mutex> lock(g.mu);
    g.running.clear();
    g.last_done = w.call;
  }

  // The call check: every rank of the group all-gathers a fingerprint of its call on the
  // group's check context and compares. Throws INVALID_ARGUMENT with each rank's call when
  // they differ; every rank sees the same fingerprints, so all fail together.
  void CheckSameCall(cai_comm_group& g, const WorkState& w) {
    constexpr size_t kFields = 6;
    const OpSpec& spec = w.spec;
    const bool reduces = spec.op == CAI_COMM_ALL_REDUCE || spec.op == CAI_COMM_REDUCE_SCATTER ||
                         spec.op == CAI_COMM_REDUCE;
    const bool rooted = spec.op == CAI_COMM_BROADCAST || spec.op == CAI_COMM_REDUCE;
    const bool has_data = spec.op != CAI_COMM_BARRIER;
    const comm::DType dtype =
        spec.output.numel > 0 || spec.input.numel == 0 ? spec.output.dtype : spec.input.dtype;
    const std::array<int64_t, kFields> mine = {spec.op,
                                               reduces ? spec.reduce : -1,
                                               has_data ? static_cast<int64_t>(dtype) : -1,
                                               static_cast<int64_t>(spec.input.numel),
                                               static_cast<int64_t>(spec.output.numel),
                                               rooted ? spec.root : -1};
    std::vector<int64_t> all(kFields * static_cast<size_t>(g.size));
    comm::AllGatherInt64(*g.check_context, mine.data(), all.data(), kFields, spec.timeout);
    bool same = true;
    for (size_t i = 0; i < all.size(); ++i) same = same && all[i] == mine[i % kFields];
    if (same) return;
    std::string calls;
    for (int r = 0; r < g.size; ++r) {
      const int64_t* f = all.data() + static_cast<size_t>(r) * kFields;
      calls += "\n  " + g.RankName(r) + ": " + DescribeCall(f[0], f[1], f[2], f[3], f[4], f[5]);
    }
    throw Error(CAI_INVALID_ARGUMENT,
                "ranks called different collectives as " + w.call + ":" + calls +
                    "\nevery rank of a group must issue the same collectives in the same order, "
                    "with the same element counts, dtype, reduce op and root (the check costs "
                    "one small all-gather per collective; launch.check_calls = false skips it)");
  }

  // "all_reduce(sum) of 1000 float32", "all_gather of 4 float32 into 8", "broadcast from/to
  // root 0 of 16 int64", "barrier".
  static std::string DescribeCall(int64_t op, int64_t reduce, int64_t dtype, int64_t in,
                                  int64_t out, int64_t root) {
    static constexpr const char* kReduce[] = {"sum", "avg", "max", "min", "product"};
    std::string text = CommOpName(static_cast<cai_comm_op>(op));
    if (reduce >= 0 && reduce < 5) text += std::string("(") + kReduce[reduce] + ")";
    if (root >= 0) text += " from/to root " + std::to_string(root);
    if (dtype < 0) return text;
    const char* type = comm::DTypeName(static_cast<comm::DType>(dtype));
    if (in > 0 && out > 0 && in != out) {
      return text + " of " + std::to_string(in) + " " + type + " into " + std::to_string(out);
    }
    return text + " of " + std::to_string(std::max(in, out)) + " " + type;
  }

  std::string Aborted() {
    std::lock_guard<std::mutex> lock(mu_);
    return aborted_;
  }

  // What this rank's workers are doing, for the heartbeat: the collectives running (and for how
  // long), else the last ones finished.
  std::string Activity() {
    std::lock_guard<std::mutex> lock(mu_);
    std::string running;
    std::string done;
    const auto now = std::chrono::steady_clock::now();
    for (cai_comm_group* g : groups_) {
      std::lock_guard<std::mutex> group_lock(g->mu);
      if (!g->running.empty()) {
        char seconds[32];
        std::snprintf(seconds, sizeof seconds, " for %.1f s",
                      std::chrono::duration<double>(now - g->running_since).count());
        running += (running.empty() ? "" : ", ") + g->running + seconds;
      } else if (!g->last_done.empty()) {
        done += (done.empty() ? "" : ", ") + g->last_done;
      }
    }
    if (!running.empty()) return running;
    return done.empty() ? "no collective yet"
                        : "no collective (computing or idle; last finished: " + done + ")";
  }

  // A peer is lost: every group is broken with `report`, and its connections are shut down so
  // that what waits on them returns now rather than at its timeout.
  void Abort(const std::string& report) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!aborted_.empty()) return;
    aborted_ = report;
    for (cai_comm_group* g : groups_) {
      {
        std::lock_guard<std::mutex> group_lock(g->mu);
        if (g->broken.empty()) g->broken = report;
      }
      for (gloo::Context* lane : g->lanes) comm::ShutdownConnections(*lane);
      if (g->check_context) comm::ShutdownConnections(*g->check_context);
      if (g->shm) g->shm->Abort();
    }
  }

  // Waits for the group's posted receives (sends: 1) in posting order.
  void PointToPointLoop(cai_comm_group& g, size_t sends) {
    auto& posted = g.p2p[sends];
    for (;;) {
      std::shared_ptr<WorkState> w;
      std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
      {
        std::unique_lock<std::mutex> lock(g.mu);
        g.p2p_cv.wait(lock, [&] { return !posted.empty() || (g.stopping && g.queue.empty()); });
        if (posted.empty()) return;
        std::tie(w, buffer) = std::move(posted.front());
        posted.pop_front();
      }
      try {
        comm::WaitPointToPoint(*buffer, w->spec);
        WirePointToPoint(g, w->spec.op);
        w->Finish(CAI_OK, {});
      } catch (const std::exception& e) {
        WirePointToPoint(g, w->spec.op);
        const cai_status_code code = Classify(e.what());
        if (code == CAI_UNAVAILABLE) ExplainClosed(g, *w, e.what());
        if (std::string aborted = Aborted(); !aborted.empty()) {
          Fail(g, *w, CAI_UNAVAILABLE, aborted);
          continue;
        }
        std::string message = e.what();
        if (code == CAI_DEADLINE_EXCEEDED) {
          message = "timed out after " + std::to_string(w->spec.timeout.count()) +
                    " ms: " + g.RankName(w->spec.peer) + " did not post the matching " +
                    (w->spec.op == CAI_COMM_SEND ? "recv" : "send") + " [gloo: " + e.what() + "]";
        }
        Fail(g, *w, code, message);
      }
    }
  }

  CommOptions options_;
  std::unique_ptr<comm::Store> store_;
  std::unique_ptr<ProgressBoard> progress_;
  std::string aborted_;  // the report that aborted the communicator; guarded by mu_
  std::string bind_description_;
  std::vector<std::shared_ptr<gloo::transport::Device>> devices_;  // one per lane
  std::string backend_info_;
  std::atomic<int> next_group_id_{0};
  cai_comm_group* world_ = nullptr;
  mutable std::mutex mu_;
  std::set<cai_comm_group*> groups_;
  ::Counters totals_;
  // Last member: destroyed first, as its threads call Activity and Abort.
  std::unique_ptr<comm::Liveness> liveness_;
};

Communicator::Communicator(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Communicator::~Communicator() = default;

Communicator& Communicator::Init(const CommOptions& options) {
  std::lock_guard<std::mutex> lock(g_instance_mu);
  if (g_instance) {
    throw Error(CAI_FAILED_PRECONDITION,
                "the communicator is already initialised in this process (rank " +
                    std::to_string(g_instance->rank()) + ")");
  }
  g_instance.reset(new Communicator(std::make_unique<Impl>(options)));
  return *g_instance;
}

Communicator* Communicator::Get() {
  std::lock_guard<std::mutex> lock(g_instance_mu);
  return g_instance.get();
}

void Communicator::Shutdown() {
  std::unique_ptr<Communicator> instance;
  {
    std::lock_guard<std::mutex> lock(g_instance_mu);
    instance = std::move(g_instance);
  }
}

int Communicator::rank() const { return impl_->options().rank; }
int Communicator::world_size() const { return impl_->options().world_size; }
cai_comm_group* Communicator::world() { return impl_->world(); }
int Communicator::GroupRank(const cai_comm_group* group) const { return impl_->Group(group)->rank; }
int Communicator::GroupSize(const cai_comm_group* group) const { return impl_->Group(group)->size; }

cai_comm_group* Communicator::NewGroup(std::span<const int32_t> world_ranks) {
  return impl_->NewGroup(world_ranks);
}

void Communicator::DestroyGroup(cai_comm_group* group) {
  if (group == impl_->world()) return;
  impl_->DestroyGroup(group);
}

cai_comm_work* Communicator::Run(const cai_comm_args& args) { return impl_->Run(args); }

void Communicator::Wait(cai_comm_work* work, std::chrono::milliseconds timeout) {
  if (work == nullptr) throw Error(CAI_INVALID_ARGUMENT, "work_wait: work is NULL");
  WorkState& w = *work->state;
  std::unique_lock<std::mutex> lock(w.mu);
  if (timeout.count() > 0) {
    if (!w.cv.wait_for(lock, timeout, [&] { return w.done; })) {
      throw Error(CAI_DEADLINE_EXCEEDED, "waiting for " + w.description + " timed out after " +
                                             std::to_string(timeout.count()) +
                                             " ms; the operation is still queued or running");
    }
  } else {
    w.cv.wait(lock, [&] { return w.done; });
  }
  if (w.code != CAI_OK) throw Error(w.code, w.message);
}

bool Communicator::IsCompleted(cai_comm_work* work) {
  if (work == nullptr) return true;
  std::lock_guard<std::mutex> lock(work->state->mu);
  return work->state->done;
}

void Communicator::Release(cai_comm_work* work) {
  if (work == nullptr) return;
  {
    WorkState& w = *work->state;
    std::unique_lock<std::mutex> lock(w.mu);
    w.cv.wait(lock, [&] { return w.done; });
  }
  delete work;
}

void Communicator::RunSync(const cai_comm_args& args) {
  std::unique_ptr<cai_comm_work, void (*)(cai_comm_work*)> work(Run(args), &Release);
  Wait(work.get(), std::chrono::milliseconds(0));
}

void Communicator::Barrier() {
  cai_comm_args args{};
  args.struct_size = CAI_COMM_ARGS_STRUCT_SIZE;
  args.op = CAI_COMM_BARRIER;
  RunSync(args);
}

double Communicator::AllReduce(double value, cai_reduce_op op) {
  int64_t one = 1, stride = 1;
  cai_tensor t{&value, {CAI_DEVICE_CPU, 0}, 1, {CAI_DTYPE_FLOAT, 64, 1}, &one, &stride, 0};
  cai_comm_args args{};
  args.struct_size = CAI_COMM_ARGS_STRUCT_SIZE;
  args.op = CAI_COMM_ALL_REDUCE;
  args.reduce_op = op;
  args.output = &t;
  RunSync(args);
  return value;
}

std::vector<int64_t> Communicator::AllGather(std::span<const int64_t> mine) {
  std::vector<int64_t> in_data(mine.begin(), mine.end());
  std::vector<int64_t> all(mine.size() * static_cast<size_t>(world_size()));
  int64_t in_n = static_cast<int64_t>(in_data.size()), out_n = static_cast<int64_t>(all.size());
  int64_t stride = 1;
  const cai_dtype i64{CAI_DTYPE_INT, 64, 1};
  cai_tensor in{in_data.data(), {CAI_DEVICE_CPU, 0}, 1, i64, &in_n, &stride, 0};
  cai_tensor out{all.data(), {CAI_DEVICE_CPU, 0}, 1, i64, &out_n, &stride, 0};
  cai_comm_args args{};
  args.struct_size = CAI_COMM_ARGS_STRUCT_SIZE;
  args.op = CAI_COMM_ALL_GATHER;
  args.input = &in;
  args.output = &out;
  RunSync(args);
  return all;
}

cai_comm_counters Communicator::Counters(const cai_comm_group* group) const {
  return impl_->Counters(group);
}

WireCounters Communicator::WireBytes(const cai_comm_group* group) const {
  return impl_->WireBytes(group);
}

void Communicator::ResetCounters() { impl_->ResetCounters(); }

std::string Communicator::WhyNotSharedMemory(const cai_comm_group* group) const {
  return impl_->why_not_shared_memory(group);
}

bool Communicator::SharedMemory(const cai_comm_group* group) const {
  return impl_->shared_memory(group);
}

const char* Communicator::BackendInfo(const cai_comm_group* group) const {
  return impl_->backend_info(group);
}

const std::string& Communicator::BindAddress() const { return impl_->bind_description(); }

}  // namespace cai
