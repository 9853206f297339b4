// cai SDK: how much of a strategy's gradient communication its compute hid (the
// overlap_ratio of cai_strategy_stats), measured rather than assumed.
//
// A window runs from the first reduction launched in a step to the moment the last one is
// complete. Within it, the time the strategy's thread spent blocked on a reduction (waiting on
// its work, or running it synchronously) is exposed; the rest of the window the thread was
// computing while reductions were in flight. The ratio is hidden / window over every window
// so far: 0 when nothing overlaps, 1 when no rank ever waited.
#ifndef CAI_SDK_OVERLAP_HPP_
#define CAI_SDK_OVERLAP_HPP_

#include <algorithm>
#include <chrono>
#include <optional>

namespace cai::sdk {

class OverlapMeter {
 public:
  using Clock = std::chrono::steady_clock;

  // A reduction was launched (only the step's first one opens the window).
  void Launched(Clock::time_point at = Clock::now()) {
    if (!open_) open_ = at;
  }

  // Runs `wait` (a work's Wait, or a synchronous collective) and counts its time as exposed.
  template <class Fn>
  void Wait(Fn&& wait) {
    const Clock::time_point start = Clock::now();
    Launched(start);
    wait();
    Waited(start, Clock::now());
  }

  void Waited(Clock::time_point start, Clock::time_point end) {
    pending_exposed_s_ += Seconds(start, end);
  }

  // The step's last reduction is complete: closes the window.
  void Completed(Clock::time_point at = Clock::now()) {
    if (!open_) return;
    const double window = Seconds(*open_, at);
    window_s_ += window;
    exposed_s_ += std::min(pending_exposed_s_, window);
    pending_exposed_s_ = 0;
    open_.reset();
  }

  // A step abandoned before its reductions completed (a failed micro-batch) counts nothing.
  void Discard() {
    open_.reset();
    pending_exposed_s_ = 0;
  }

  double ratio() const { return window_s_ > 0 ? 1.0 - exposed_s_ / window_s_ : 0.0; }

 private:
  static double Seconds(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }

  std::optional<Clock::time_point> open_;
  double pending_exposed_s_ = 0;
  double window_s_ = 0;
  double exposed_s_ = 0;
};

}  // namespace cai::sdk

#endif  // CAI_SDK_OVERLAP_HPP_
