#include "comm/liveness.h"

#include <arpa/inet.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <set>

#include "comm/store.h"
#include "core/status.h"

namespace cai::comm {

namespace {

using Clock = std::chrono::steady_clock;

// Successors each rank watches, besides rank 0. Two, so that one slow watcher does not delay
// the verdict.
constexpr int kSuccessors = 2;
// Datagrams: "B <rank> <counter> <activity>", "L <rank>" (left), "V <report>" (verdict).
constexpr size_t kMaxDatagram = 8192;

std::string AddressKey(int rank) { return "cai/beat_addr/" + std::to_string(rank); }

std::string Seconds(Clock::duration d) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", std::chrono::duration<double>(d).count());
  return text;
}

std::set<int> WatchedBy(int rank, int world) {
  std::set<int> watched;
  if (rank != 0) watched.insert(0);
  for (int k = 1; k <= kSuccessors && k < world; ++k) watched.insert((rank + k) % world);
  return watched;
}

}  // namespace

Liveness::Liveness(Store& store, const LivenessOptions& options, Activity activity,
                   OnFailure on_failure)
    : options_(options), activity_(std::move(activity)), on_failure_(std::move(on_failure)) {
  fd_ = ::socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  wake_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  sockaddr_in self{};
  self.sin_family = AF_INET;
  socklen_t len = sizeof(self);
  char ip[INET_ADDRSTRLEN] = {};
  if (fd_ < 0 || wake_fd_ < 0 ||
      inet_pton(AF_INET, options.bind_address.c_str(), &self.sin_addr) != 1 ||
      ::bind(fd_, reinterpret_cast<sockaddr*>(&self), sizeof(self)) != 0 ||
      ::getsockname(fd_, reinterpret_cast<sockaddr*>(&self), &len) != 0 ||
      inet_ntop(AF_INET, &self.sin_addr, ip, sizeof(ip)) == nullptr) {
    const std::string why = std::strerror(errno);
    if (fd_ >= 0) ::close(fd_);
    if (wake_fd_ >= 0) ::close(wake_fd_);
    throw Error(CAI_UNAVAILABLE, "failure detection: cannot open a UDP socket on " +
                                     options.bind_address + ": " + why);
  }
  store.SetString(AddressKey(options.rank),
                  std::string(ip) + " " + std::to_string(ntohs(self.sin_port)));
}

Liveness::~Liveness() {
  StopThread();
  ::close(fd_);
  ::close(wake_fd_);
}

void Liveness::StopThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  const uint64_t one = 1;
  (void)::write(wake_fd_, &one, sizeof one);
  if (thread_.joinable()) thread_.join();
}

void Liveness::Start(Store& store) {
  const int world = options_.world_size;
  addresses_.resize(static_cast<size_t>(world));
  for (int r = 0; r < world; ++r) {
    const std::string text = store.TryGet(AddressKey(r)).value_or("");
    const size_t space = text.find(' ');
    sockaddr_in& a = addresses_[static_cast<size_t>(r)];
    a.sin_family = AF_INET;
    if (space == std::string::npos ||
        inet_pton(AF_INET, text.substr(0, space).c_str(), &a.sin_addr) != 1) {
      throw Error(CAI_INTERNAL, "failure detection: rank " + std::to_string(r) +
                                    " published no heartbeat address ('" + text + "')");
    }
    a.sin_port = htons(static_cast<uint16_t>(std::stoi(text.substr(space + 1))));
  }
  const std::set<int> watched = WatchedBy(options_.rank, world);
  watched_.assign(watched.begin(), watched.end());
  for (int r = 0; r < world; ++r) {
    if (r != options_.rank && WatchedBy(r, world).count(options_.rank)) watchers_.push_back(r);
  }
  peers_.assign(static_cast<size_t>(world), Peer{});
  for (Peer& p : peers_) p.heard = Clock::now();
  thread_ = std::thread([this] { Loop(); });
}

void Liveness::Leave() {
  StopThread();
  if (declared_) return;
  // Three times: a lost datagram would make a watcher that runs on take this rank for lost.
  const std::string left = "L " + std::to_string(options_.rank);
  for (int i = 0; i < 3; ++i) {
    for (int w : watchers_) SendTo(w, left);
  }
}

bool Liveness::CheckVerdict() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, options_.interval, [&] { return reported_ || stop_; });
  return reported_;
}

void Liveness::Report(const std::string& report) { Declare(report, true); }

void Liveness::SendTo(int rank, const std::string& message) {
  const sockaddr_in& a = addresses_[static_cast<size_t>(rank)];
  // Best effort: a datagram that cannot be sent now is a missed beat.
  (void)::sendto(fd_, message.data(), std::min(message.size(), kMaxDatagram), MSG_DONTWAIT,
                 reinterpret_cast<const sockaddr*>(&a), sizeof(a));
}

void Liveness::Declare(const std::string& report, bool broadcast) {
  if (declared_.exchange(true)) return;
  if (broadcast) {
    for (int r = 0; r < options_.world_size; ++r) {
      if (r != options_.rank) SendTo(r, "V " + report);
    }
  }
  on_failure_(report + "; rank " + std::to_string(options_.rank) + " (this rank) is in " +
              activity_());
  // Only now: a CheckVerdict woken before on_failure_ had aborted the communicator would find
  // no abort report and name the peer that hung up instead of the lost rank.
  {
    std::lock_guard<std::mutex> lock(mu_);
    reported_ = true;
  }
  cv_.notify_all();
}

void Liveness::Loop() {
  auto next_beat = Clock::now();
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_ && !declared_) {
    lock.unlock();
    const auto now = Clock::now();
    if (now >= next_beat) {
      Beat();
      next_beat = now + options_.interval;
    }
    pollfd p[2] = {{fd_, POLLIN, 0}, {wake_fd_, POLLIN, 0}};
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next_beat - now);
    if (::poll(p, 2, static_cast<int>(std::max<int64_t>(1, wait.count()))) > 0 &&
        (p[0].revents & POLLIN)) {
      Receive();
    }
    const auto after = Clock::now();
    for (int r : watched_) {
      const Peer& peer = peers_[static_cast<size_t>(r)];
      if (declared_ || peer.left || after - peer.heard <= options_.limit) continue;
      Declare("rank " + std::to_string(r) + " stopped answering: no heartbeat for " +
                  Seconds(after - peer.heard) + " (limit " + Seconds(options_.limit) +
                  "; a hung or stopped process, or a lost node); its last heartbeat said it was "
                  "in " +
                  peer.activity + " (noticed by rank " + std::to_string(options_.rank) + ")",
              true);
    }
    lock.lock();
  }
}

void Liveness::Beat() {
  const std::string beat =
      "B " + std::to_string(options_.rank) + " " + std::to_string(++beats_) + " " + activity_();
  for (int w : watchers_) SendTo(w, beat);
}

void Liveness::Receive() {
  char buffer[kMaxDatagram];
  for (;;) {
    const ssize_t n = ::recv(fd_, buffer, sizeof buffer, MSG_DONTWAIT);
    if (n <= 2) return;
    const std::string text(buffer, static_cast<size_t>(n));
    if (text[0] == 'V') {
      Declare(text.substr(2), false);
      return;
    }
    // "B <rank> <counter> <activity>" or "L <rank>".
    const size_t rank_end = text.find(' ', 2);
    int rank = -1;
    try {
      rank = std::stoi(text.substr(2, rank_end - 2));
    } catch (const std::exception&) {
      continue;  // not ours
    }
    if (rank < 0 || rank >= options_.world_size) continue;
    Peer& peer = peers_[static_cast<size_t>(rank)];
    if (text[0] == 'L') {
      peer.left = true;
    } else if (text[0] == 'B' && rank_end != std::string::npos) {
      peer.heard = Clock::now();
      const size_t counter_end = text.find(' ', rank_end + 1);
      if (counter_end != std::string::npos) peer.activity = text.substr(counter_end + 1);
    }
  }
}

}  // namespace cai::comm
