// Failure detection that does not wait for a collective's timeout: heartbeats through the
// rendezvous store.
//
// A killed rank is noticed at once by its peers' Gloo connections (the kernel resets them),
// but a hung rank (SIGSTOP, a deadlock, a GPU hang) or a lost node resets nothing, and a peer
// waiting for it in a collective would wait out the whole collective timeout (300 s by
// default). Here every rank runs a heartbeat thread on its own store connection: each
// `interval` it writes "<beat counter>|<what this rank is doing>" to cai/beat/<rank>, checks
// cai/verdict, and reads the beats of the peers it watches. A peer whose counter has not moved
// for `limit` is declared lost; so is rank 0 when the store it serves stops answering for
// `limit` (a guard thread watches the heartbeat thread's last successful round trip, so a
// store that hangs rather than refuses is caught too). A stopped process stops its heartbeat
// thread with it, which is what makes a hang visible; a long collective on a healthy group
// keeps beating and never trips it.
//
// Who watches whom: rank r watches its kWatched successors r+1, r+2, ... (mod the world), so
// the store sees O(world) requests a second, not O(world²). Whatever set of ranks fails, some
// live rank's successor is among them, so some live rank notices; it publishes its report
// under cai/verdict, which every rank reads each interval. Every live rank thus learns within
// limit + 2 × interval of the last beat (7 s with the defaults).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace cai::comm {

class Store;

struct LivenessOptions {
  int rank = 0;
  int world_size = 1;
  std::chrono::milliseconds interval{1000};  // between heartbeats
  std::chrono::milliseconds limit{5000};     // a peer silent this long is lost
  std::string store_address;                 // "host:port" of rank 0's store, for messages
};

// Thread-safe.
class Liveness {
 public:
  // What this rank is doing now, e.g. "all_reduce #783 on group 'world'". Called on the
  // heartbeat thread; must not block.
  using Activity = std::function<std::string()>;
  // Called once, on a monitor thread, with the report naming the lost rank, what it was doing
  // and what this rank is doing. May end the process.
  using OnFailure = std::function<void(const std::string& report)>;
  // Anything fresher than the heartbeat (beats are up to `interval` old) known of what rank
  // `rank` was doing, as a phrase to append ("; the last collective it started was #5 ..."),
  // or "". Called on the heartbeat thread when the rank is declared lost.
  using LastKnown = std::function<std::string(int rank)>;

  // Publishes this rank's first beat. Call before the world's rendezvous completes, so that
  // every rank's beat key exists once any rank starts watching.
  static void Announce(Store& store, int rank);

  // Starts the threads. `store` is this monitor's own connection.
  Liveness(std::unique_ptr<Store> store, const LivenessOptions& options, Activity activity,
           OnFailure on_failure, LastKnown last_known);
  // Stops the threads without announcing anything (Leave first for a clean exit).
  ~Liveness();
  Liveness(const Liveness&) = delete;
  Liveness& operator=(const Liveness&) = delete;

  // A clean exit: marks this rank's beat "left", so peers stop watching it, and stops the
  // threads. Rank 0, which serves the store, then waits up to limit + interval for every
  // other rank to have left, so that no rank still watching takes the store's end for its
  // death.
  void Leave();

  // For a rank whose connection to a peer just closed: true when a failure has been declared
  // (here, or by a rank that published its verdict: a rank that aborts publishes first, so
  // its peers name the rank that was lost rather than the one that hung up on them); the
  // verdict is then declared here too. False when the peer closed on its own (it exited or was
  // killed). May block while the store does not answer.
  bool CheckVerdict();

 private:
  void BeatLoop();
  void GuardLoop();
  void Beat();
  // Reports once: publishes `report` under cai/verdict unless `publish` is false (it came
  // from there) and calls on_failure_.
  void Declare(const std::string& report, bool publish);
  std::string Self() const;
  // "; its last heartbeat said it was in ..." for rank 0, or "" before its first beat.
  std::string Rank0Last();

  std::unique_ptr<Store> store_;
  const LivenessOptions options_;
  const Activity activity_;
  const OnFailure on_failure_;
  const LastKnown last_known_;
  std::vector<int> watched_;

  struct Peer {
    std::string value;  // the last beat read
    std::chrono::steady_clock::time_point changed;
  };
  std::vector<Peer> peers_;  // by position in watched_; heartbeat thread only
  uint64_t beats_ = 0;       // heartbeat thread only

  std::atomic<int64_t> last_ok_ns_{0};  // steady_clock of the last store round trip that answered
  std::atomic<bool> declared_{false};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;       // guarded by mu_
  std::string rank0_beat_;  // rank 0's last beat; guarded by mu_
  std::thread beat_thread_;
  std::thread guard_thread_;
};

}  // namespace cai::comm
