// Failure detection that does not wait for a collective's timeout: heartbeats over UDP.
//
// A killed rank is noticed at once by its peers' Gloo connections (the kernel resets them),
// but a hung rank (SIGSTOP, a deadlock, a stuck device) or a lost node resets nothing, and a
// peer waiting for it in a collective would wait out the whole collective timeout (300 s by
// default). Here every rank runs a heartbeat thread with a UDP socket of its own, bound to the
// collectives' address (its port published through the rendezvous store at start): each
// `interval` it sends "<counter> <what this rank is doing>" to the ranks that watch it, and it
// reads the beats of the ranks it watches. A watched rank not heard from for `limit` is
// declared lost. A stopped process stops its heartbeat thread with it, which is what makes a
// hang visible; a long collective on a healthy group keeps beating and never trips it.
//
// Why datagrams and not the rendezvous store: c10d's TCPStore server reads each request with
// blocking reads, so a client stopped halfway through writing one (a SIGSTOPped rank's
// progress or heartbeat writer) hangs the store for everyone. A datagram arrives whole or not
// at all, and nothing here waits on another process.
//
// Who watches whom: every rank watches rank 0 (which also serves the store) and its two
// successors r+1, r+2 (mod the world), so a rank sends two beats per interval (rank 0: one
// to every rank). Whatever set of ranks fails, some live rank's successor is among them,
// so some live rank notices; it sends its report to every rank, and every live rank thus
// learns within limit + interval of the last beat (5.5 s with the defaults).
#pragma once

#include <netinet/in.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace cai::comm {

class Store;

struct LivenessOptions {
  int rank = 0;
  int world_size = 1;
  std::chrono::milliseconds interval{500};  // between heartbeats
  std::chrono::milliseconds limit{5000};    // a watched rank silent this long is lost
  std::string bind_address;                 // this rank's IPv4 address, as the collectives'
};

// Thread-safe.
class Liveness {
 public:
  // What this rank is doing now, e.g. "all_reduce #783 on group 'world' for 0.2 s". Called on
  // the heartbeat thread; must not block.
  using Activity = std::function<std::string()>;
  // Called once, on the heartbeat thread (or the thread calling CheckVerdict), with the report
  // naming the lost rank, what it was doing and what this rank is doing. May end the process.
  using OnFailure = std::function<void(const std::string& report)>;

  // Opens this rank's heartbeat socket and publishes its address in `store`. Every rank
  // constructs one before the world's rendezvous completes, so that Start finds every address.
  Liveness(Store& store, const LivenessOptions& options, Activity activity, OnFailure on_failure);
  // Stops the thread without telling anyone (Leave first for a clean exit).
  ~Liveness();
  Liveness(const Liveness&) = delete;
  Liveness& operator=(const Liveness&) = delete;

  // After the world's rendezvous: reads the peers' addresses from `store` and starts beating.
  void Start(Store& store);

  // A clean exit: stops the thread and tells the ranks watching this one that it left, so a
  // rank that finishes later does not take it for lost.
  void Leave();

  // For a rank whose connection to a peer just closed: waits up to one interval for a verdict
  // (a rank that aborts for a lost rank sends its report before it closes its connections, so
  // its peers name the rank that was lost rather than the one that hung up on them). True when
  // a failure was declared, here or (then declared here too) by another rank; false when the
  // peer closed on its own (it exited or was killed).
  bool CheckVerdict();

  // For a rank that saw a peer close its connection with no verdict to explain it: declares
  // `report` here and sends it to every rank before this rank aborts and closes its own
  // connections, so that a rank which then sees *this* rank hang up names the first loss, not
  // the cascade (rank 2 killed, rank 1 noticing and exiting, rank 0 meeting only rank 1).
  void Report(const std::string& report);

 private:
  void Loop();
  void Receive();
  void Beat();
  void SendTo(int rank, const std::string& message);
  // Reports once: sends `report` to every rank when `broadcast`, then calls on_failure_.
  void Declare(const std::string& report, bool broadcast);
  // Ends the heartbeat thread now, not at its next beat.
  void StopThread();

  const LivenessOptions options_;
  const Activity activity_;
  const OnFailure on_failure_;
  int fd_ = -1;
  int wake_fd_ = -1;  // an eventfd the heartbeat thread polls beside fd_, written to stop it
  std::vector<sockaddr_in> addresses_;  // by rank
  std::vector<int> watched_;            // ranks whose beats this rank checks
  std::vector<int> watchers_;           // ranks this rank sends its beats to

  struct Peer {
    std::string activity = "nothing reported yet";
    std::chrono::steady_clock::time_point heard;
    bool left = false;
  };
  std::vector<Peer> peers_;  // by rank; heartbeat thread only
  uint64_t beats_ = 0;       // heartbeat thread only

  std::atomic<bool> declared_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;      // guarded by mu_
  bool reported_ = false;  // on_failure_ has returned; guarded by mu_
  std::thread thread_;
};

}  // namespace cai::comm
