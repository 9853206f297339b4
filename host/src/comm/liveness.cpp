#include "comm/liveness.h"

#include <cstdio>
#include <set>

#include "comm/store.h"

namespace cai::comm {

namespace {

using Clock = std::chrono::steady_clock;

// Successors each rank watches, besides rank 0 (whose beat tells what it was doing should its
// store vanish). Two, so that one slow watcher does not delay the verdict.
constexpr int kWatched = 2;
constexpr const char* kVerdictKey = "cai/verdict";
constexpr const char* kLeft = "left";

std::string BeatKey(int rank) { return "cai/beat/" + std::to_string(rank); }

std::string Seconds(Clock::duration d) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f s", std::chrono::duration<double>(d).count());
  return text;
}

// What a beat value ("<counter>|<activity>") says the rank was doing.
std::string ActivityOf(const std::string& beat) {
  const size_t bar = beat.find('|');
  return bar == std::string::npos ? "nothing reported yet" : beat.substr(bar + 1);
}

int64_t Now() { return Clock::now().time_since_epoch().count(); }

}  // namespace

void Liveness::Announce(Store& store, int rank) { store.SetString(BeatKey(rank), "0|starting"); }

Liveness::Liveness(std::unique_ptr<Store> store, const LivenessOptions& options, Activity activity,
                   OnFailure on_failure, LastKnown last_known)
    : store_(std::move(store)),
      options_(options),
      activity_(std::move(activity)),
      on_failure_(std::move(on_failure)),
      last_known_(std::move(last_known)) {
  std::set<int> watched;
  if (options.rank != 0) watched.insert(0);
  for (int k = 1; k <= kWatched && k < options.world_size; ++k) {
    watched.insert((options.rank + k) % options.world_size);
  }
  watched_.assign(watched.begin(), watched.end());
  peers_.assign(watched_.size(), Peer{"", Clock::now()});
  last_ok_ns_ = Now();
  beat_thread_ = std::thread([this] { BeatLoop(); });
  guard_thread_ = std::thread([this] { GuardLoop(); });
}

Liveness::~Liveness() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (beat_thread_.joinable()) beat_thread_.join();
  if (guard_thread_.joinable()) guard_thread_.join();
}

void Liveness::Leave() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (beat_thread_.joinable()) beat_thread_.join();
  if (guard_thread_.joinable()) guard_thread_.join();
  if (declared_) return;
  try {
    store_->SetString(BeatKey(options_.rank), kLeft);
    if (options_.rank != 0) return;
    const auto deadline = Clock::now() + options_.limit + options_.interval;
    for (int r = 1; r < options_.world_size && Clock::now() < deadline;) {
      if (store_->TryGet(BeatKey(r)) == kLeft) {
        ++r;
      } else {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    }
  } catch (const std::exception&) {
    // The store is gone: nobody is left to watch this rank.
  }
}

bool Liveness::CheckVerdict() {
  if (declared_) return true;
  try {
    if (auto verdict = store_->TryGet(kVerdictKey)) {
      Declare(*verdict, false);
      return true;
    }
  } catch (const std::exception&) {
    // No store, no verdict: the closed connection is the news.
  }
  return declared_;
}

std::string Liveness::Rank0Last() {
  std::lock_guard<std::mutex> lock(mu_);
  if (rank0_beat_.empty()) return "";
  return "; its last heartbeat said it was in " + ActivityOf(rank0_beat_);
}

std::string Liveness::Self() const {
  return "rank " + std::to_string(options_.rank) + " (this rank) is in " + activity_();
}

void Liveness::Declare(const std::string& report, bool publish) {
  if (declared_.exchange(true)) return;
  if (publish) {
    try {
      store_->SetString(kVerdictKey, report);
    } catch (const std::exception&) {
      // The others will find out on their own: the store, or the rank, is gone.
    }
  }
  on_failure_(report + "; " + Self());
}

void Liveness::BeatLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_ && !declared_) {
    lock.unlock();
    try {
      Beat();
    } catch (const std::exception& e) {
      Declare("rank 0 is gone: the rendezvous store it serves at " + options_.store_address +
                  " failed (" + e.what() + ")" + Rank0Last(),
              false);
    }
    lock.lock();
    cv_.wait_for(lock, options_.interval, [&] { return stop_; });
  }
}

void Liveness::Beat() {
  store_->SetString(BeatKey(options_.rank), std::to_string(++beats_) + "|" + activity_());
  last_ok_ns_ = Now();
  if (auto verdict = store_->TryGet(kVerdictKey)) {
    Declare(*verdict, false);
    return;
  }
  last_ok_ns_ = Now();
  for (size_t i = 0; i < watched_.size(); ++i) {
    Peer& peer = peers_[i];
    if (peer.value == kLeft) continue;
    std::string value = store_->TryGet(BeatKey(watched_[i])).value_or("");
    last_ok_ns_ = Now();
    if (watched_[i] == 0) {
      std::lock_guard<std::mutex> lock(mu_);
      rank0_beat_ = value;
    }
    const auto now = Clock::now();
    if (value != peer.value) {
      peer.value = std::move(value);
      peer.changed = now;
    } else if (now - peer.changed > options_.limit) {
      const int lost = watched_[i];
      Declare("rank " + std::to_string(lost) + " stopped answering: no heartbeat for " +
                  Seconds(now - peer.changed) + " (limit " + Seconds(options_.limit) +
                  "; a hung or stopped process, or a lost node); its last heartbeat said it was "
                  "in " +
                  ActivityOf(peer.value) + (last_known_ ? last_known_(lost) : "") +
                  " (noticed by rank " + std::to_string(options_.rank) + ")",
              true);
      return;
    }
  }
}

void Liveness::GuardLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_ && !declared_) {
    cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stop_; });
    const Clock::duration silent = Clock::duration(Now() - last_ok_ns_.load());
    if (stop_ || silent <= options_.limit) continue;
    lock.unlock();
    Declare("rank 0 is unreachable: the rendezvous store it serves at " + options_.store_address +
                " has not answered for " + Seconds(silent) + " (limit " + Seconds(options_.limit) +
                "; a hung or stopped rank 0, or a lost node or network)" + Rank0Last(),
            false);
    lock.lock();
  }
}

}  // namespace cai::comm
