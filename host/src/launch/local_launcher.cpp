#include "launch/local_launcher.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/lsan_interface.h>
#endif

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>

#include "core/status.h"
#include "core/strings.h"
#include "launch/port_reservation.h"

extern char** environ;

namespace cai::launch {
namespace {

using Clock = std::chrono::steady_clock;

// A rank's line longer than this is passed on in pieces rather than buffered without bound.
constexpr size_t kMaxLine = 64 * 1024;
// How often the launcher looks at its children when no output arrives.
constexpr int kPollMs = 100;
// After a rank fails having reported an error, how long the others have to fail too before
// they are stopped: ranks that hit the same bad input fail within milliseconds of each other,
// and the launcher can then say "ranks 0,1" instead of blaming whichever was reaped first.
constexpr std::chrono::milliseconds kReportWindow{1000};

volatile sig_atomic_t g_interrupt_signal = 0;
constexpr std::array<int, 3> kInterruptSignals{SIGINT, SIGTERM, SIGHUP};
ProgramEntry g_program_entry = nullptr;

// Writes out what the program may have buffered: stdio and iostreams, which the loggers' files
// write through.
void FlushBuffers() {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
}

// Ends this process without destroying its static objects, after FlushBuffers. A forked rank
// leaves so: the static objects it would destroy are the launcher's copies (LibTorch's
// registries, mostly), and freeing them wrote to pages the fork shares with the launcher, which
// took a rank ~0.45 s of copy-on-write. Under AddressSanitizer, `check_leaks` first runs the
// leak check that exit would have run.
[[noreturn]] void LeaveNow(int code, bool check_leaks) {
  FlushBuffers();
#if defined(__SANITIZE_ADDRESS__)
  if (check_leaks) __lsan_do_leak_check();
#else
  (void)check_leaks;
#endif
  ::_exit(code);
}

// Whether this process runs only the calling thread.
bool SingleThreaded() {
  std::error_code ec;
  const auto tasks = std::filesystem::directory_iterator("/proc/self/task", ec);
  return !ec && std::distance(tasks, std::filesystem::directory_iterator()) == 1;
}

void OnInterrupt(int sig) { g_interrupt_signal = sig; }

// Installs OnInterrupt for the launcher's lifetime; without SA_RESTART so poll() wakes up.
class InterruptHandlers {
 public:
  InterruptHandlers() {
    g_interrupt_signal = 0;
    struct sigaction action {};
    action.sa_handler = OnInterrupt;
    sigemptyset(&action.sa_mask);
    for (size_t i = 0; i < kInterruptSignals.size(); ++i) {
      sigaction(kInterruptSignals[i], &action, &previous_[i]);
    }
  }
  ~InterruptHandlers() {
    for (size_t i = 0; i < kInterruptSignals.size(); ++i) {
      sigaction(kInterruptSignals[i], &previous_[i], nullptr);
    }
  }
  InterruptHandlers(const InterruptHandlers&) = delete;
  InterruptHandlers& operator=(const InterruptHandlers&) = delete;

 private:
  std::array<struct sigaction, 3> previous_{};
};

std::string DescribeStatus(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = sigabbrev_np(sig);
    return "was killed by signal " + std::to_string(sig) +
           (name ? std::string(" (SIG") + name + ")" : std::string());
  }
  return "ended with wait status " + std::to_string(status);
}

int ExitCodeFor(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string Unescape(std::string_view text) {
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (text[i] == '\\' && i + 1 < text.size()) {
      ++i;
      out.push_back(text[i] == 'n' ? '\n' : text[i]);
    } else {
      out.push_back(text[i]);
    }
  }
  return out;
}

// VT100's "erase to the end of the line", which every terminal emulator understands.
constexpr std::string_view kEraseToEnd = "\033[K";

std::string RankPrefix(int rank) { return "[rank " + std::to_string(rank) + "] "; }

void WriteFd(Stream stream, std::string_view text) {
  const int fd = stream == Stream::kStdout ? STDOUT_FILENO : STDERR_FILENO;
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

struct Pipe {
  int fd = -1;
  std::string pending;
};

struct Child {
  pid_t pid = -1;
  bool reaped = false;
  int status = 0;
  bool failed_on_its_own = false;
  bool stopped = false;  // ended, successfully or not, after the launcher began stopping ranks
  bool reported_error = false;  // wrote a RankErrorLine
  Pipe out, err;
  // Readable once the child has ended (a pidfd), so that poll() wakes for its exit as it does
  // for its output; -1 where the kernel has no pidfds, and the poll's timeout finds the exit.
  int exit_fd = -1;
};

class Launcher {
 public:
  explicit Launcher(const LaunchOptions& options)
      : options_(options),
        console_(::isatty(STDOUT_FILENO) == 1, {}, TerminalColumns(STDOUT_FILENO)) {}

  ~Launcher() {
    // Only reached with live children when something threw: leave nothing behind.
    Signal(SIGKILL);
    for (Child& c : children_) {
      if (!c.reaped && c.pid > 0) ::waitpid(c.pid, &c.status, 0);
      CloseFd(c.out.fd);
      CloseFd(c.err.fd);
      CloseFd(c.exit_fd);
    }
  }

  LaunchResult Run() {
    Start();
    while (true) {
      Pump();
      Reap();
      if (!stopping_ && stop_at_ && Clock::now() >= *stop_at_) StopAll();
      if (!stopping_ && g_interrupt_signal != 0) {
        interrupt_ = g_interrupt_signal;
        StopAll();
      }
      if (kill_at_ && Clock::now() >= *kill_at_) {
        Signal(SIGKILL);
        killed_ = true;
        kill_at_.reset();
      }
      if (AllReaped()) {
        // A grandchild may still hold a pipe open; give it a moment, then stop listening.
        if (!drain_until_) drain_until_ = Clock::now() + std::chrono::seconds(1);
        if (!AnyFdOpen() || Clock::now() >= *drain_until_) break;
      }
    }
    for (Child& c : children_) {
      Flush(&c - children_.data(), c.out, Stream::kStdout);
      Flush(&c - children_.data(), c.err, Stream::kStderr);
      CloseFd(c.out.fd);
      CloseFd(c.err.fd);
    }
    console_.Finish();
    LaunchResult result;
    for (const auto& [message, ranks] : rank_errors_) {
      std::string who = ranks.size() == 1 ? "rank " : "ranks ";
      for (size_t i = 0; i < ranks.size(); ++i) who += (i ? "," : "") + std::to_string(ranks[i]);
      result.rank_errors.push_back(who + ": " + message);
    }
    for (const Child& c : children_) {
      result.pids.push_back(c.pid);
      result.wait_statuses.push_back(c.status);
    }
    if (interrupt_) {
      result.exit_code = 128 + *interrupt_;
      result.message = "the launcher got signal " + std::to_string(*interrupt_) + "; " + Stopped();
    } else if (const Child* cause = RootCause()) {
      result.exit_code = ExitCodeFor(cause->status);
      result.message = Describe(*cause);
      for (const Child& c : children_) {
        if (&c != cause && c.failed_on_its_own) result.message += "; also " + Describe(c);
      }
      result.message += "; " + Stopped();
    }
    return result;
  }

 private:
  void Start() {
    const std::filesystem::path exe = options_.executable.empty()
                                          ? std::filesystem::read_symlink("/proc/self/exe")
                                          : options_.executable;
    if (::access(exe.c_str(), X_OK) != 0) {
      throw Error(CAI_INVALID_ARGUMENT,
                  "cannot run ranks from " + exe.string() + ": " + std::strerror(errno));
    }
    if (options_.master_port <= 0) reserved_port_.emplace(options_.master_addr);
    const int port = options_.master_port > 0 ? options_.master_port : reserved_port_->port();
    const std::string run_id = "local-" + std::to_string(::getpid()) + "-" +
                               std::to_string(Clock::now().time_since_epoch().count());

    std::vector<std::pair<std::string, std::string>> common = options_.env;
    common.emplace_back("WORLD_SIZE", std::to_string(options_.nproc));
    common.emplace_back("LOCAL_WORLD_SIZE", std::to_string(options_.nproc));
    common.emplace_back("MASTER_ADDR", options_.master_addr);
    common.emplace_back("MASTER_PORT", std::to_string(port));
    common.emplace_back("CAI_RUN_ID", run_id);
    common.emplace_back(kStdoutTerminalVar, InPlace() ? "1" : "0");
    const int columns = InPlace() ? TerminalColumns(STDOUT_FILENO) : 0;
    if (columns > 0) {
      const size_t prefix = RankPrefix(options_.nproc - 1).size();
      common.emplace_back(kStdoutColumnsVar,
                          std::to_string(std::max<int>(1, columns - static_cast<int>(prefix))));
    }

    std::vector<std::string> argv_strings{exe.string()};
    argv_strings.insert(argv_strings.end(), options_.args.begin(), options_.args.end());
    std::vector<char*> argv;
    for (std::string& s : argv_strings) argv.push_back(s.data());
    argv.push_back(nullptr);

    // Fork is only safe to go on from without exec where no other thread may hold a lock
    // (the allocator's, a logger's) at the fork.
    const bool in_process = options_.executable.empty() && g_program_entry && SingleThreaded();
    if (in_process) {
      // A fork copies unwritten buffers: the ranks would write them again.
      FlushBuffers();
    }
    const pid_t launcher_pid = ::getpid();
    pid_t pgid = 0;
    children_.resize(static_cast<size_t>(options_.nproc));
    for (int rank = 0; rank < options_.nproc; ++rank) {
      auto vars = common;
      vars.emplace_back("RANK", std::to_string(rank));
      vars.emplace_back("LOCAL_RANK", std::to_string(rank));
      // Everything the child needs is built before fork: after fork only async-signal-safe
      // calls are allowed, as other threads may hold the allocator's lock.
      std::vector<std::string> env_strings = Environment(vars);
      std::vector<char*> envp;
      for (std::string& s : env_strings) envp.push_back(s.data());
      envp.push_back(nullptr);

      int out[2], err[2];
      if (::pipe2(out, O_CLOEXEC) != 0) throw Error(CAI_INTERNAL, "pipe failed");
      if (::pipe2(err, O_CLOEXEC) != 0) {
        ::close(out[0]);
        ::close(out[1]);
        throw Error(CAI_INTERNAL, "pipe failed");
      }
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::setpgid(0, pgid);
        ::prctl(PR_SET_PDEATHSIG, SIGKILL);
        // The launcher may have died before prctl took effect.
        if (::getppid() != launcher_pid) ::_exit(127);
        ::dup2(out[1], STDOUT_FILENO);
        ::dup2(err[1], STDERR_FILENO);
        if (in_process) {
          BecomeRank(out, err);
          environ = envp.data();
          // Nothing may unwind from here into the launcher's frames, which this process does
          // not run.
          int code = 1;
          try {
            code = g_program_entry(static_cast<int>(argv.size()) - 1, argv.data());
          } catch (...) {
          }
          LeaveNow(code, /*check_leaks=*/true);
        }
        ::execve(argv[0], argv.data(), envp.data());
        const char msg[] = "cai launcher: execve failed\n";
        [[maybe_unused]] auto ignored = ::write(STDERR_FILENO, msg, sizeof(msg) - 1);
        ::_exit(127);
      }
      ::close(out[1]);
      ::close(err[1]);
      Child& child = children_[static_cast<size_t>(rank)];
      child.out.fd = out[0];
      child.err.fd = err[0];
      if (pid < 0)
        throw Error(CAI_RESOURCE_EXHAUSTED, "fork failed for rank " + std::to_string(rank));
      child.pid = pid;
      child.exit_fd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
      // Also from the parent, so the group exists before the next fork whatever the order.
      ::setpgid(pid, pgid == 0 ? pid : pgid);
      if (pgid == 0) pgid = pid;
    }
    pgid_ = pgid;
  }

  // In a rank forked to run the program's entry: what execve would have done to the launcher's
  // state. The launcher's descriptors (all close-on-exec) are closed, and its signal handlers
  // reset; the rest of its memory is the program as it was before the launch, and the entry
  // runs the command again from its arguments.
  void BecomeRank(const int out[2], const int err[2]) {
    for (int fd : {out[0], out[1], err[0], err[1]}) {
      if (fd > STDERR_FILENO) ::close(fd);
    }
    for (const Child& c : children_) {
      for (int fd : {c.out.fd, c.err.fd, c.exit_fd}) {
        if (fd >= 0) ::close(fd);
      }
    }
    if (reserved_port_) reserved_port_->CloseInChild();
    struct sigaction action {};
    action.sa_handler = SIG_DFL;
    for (int sig : kInterruptSignals) ::sigaction(sig, &action, nullptr);
  }

  static std::vector<std::string> Environment(
      const std::vector<std::pair<std::string, std::string>>& vars) {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string_view entry(*e);
      const std::string_view key = entry.substr(0, entry.find('='));
      bool overridden = false;
      for (const auto& [k, v] : vars) overridden = overridden || k == key;
      if (!overridden) env.emplace_back(entry);
    }
    for (const auto& [k, v] : vars) env.push_back(k + "=" + v);
    return env;
  }

  void Pump() {
    std::vector<pollfd> fds;
    std::vector<std::pair<size_t, Stream>> owners;
    for (size_t i = 0; i < children_.size(); ++i) {
      for (Stream s : {Stream::kStdout, Stream::kStderr}) {
        const Pipe& p = s == Stream::kStdout ? children_[i].out : children_[i].err;
        if (p.fd >= 0) {
          fds.push_back({p.fd, POLLIN, 0});
          owners.emplace_back(i, s);
        }
      }
    }
    const size_t pipes = fds.size();
    for (const Child& c : children_) {
      if (!c.reaped && c.exit_fd >= 0) fds.push_back({c.exit_fd, POLLIN, 0});
    }
    if (fds.empty()) {
      ::usleep(kPollMs * 1000);
      return;
    }
    if (::poll(fds.data(), fds.size(), kPollMs) <= 0) return;
    for (size_t k = 0; k < pipes; ++k) {
      if (fds[k].revents == 0) continue;
      const auto [i, stream] = owners[k];
      ReadOnce(i, stream);
    }
  }

  // One read() of a child's pipe that poll() found ready; closes the pipe at its end.
  void ReadOnce(size_t i, Stream stream) {
    Pipe& p = stream == Stream::kStdout ? children_[i].out : children_[i].err;
    char buffer[65536];
    const ssize_t n = ::read(p.fd, buffer, sizeof(buffer));
    if (n > 0) {
      p.pending.append(buffer, static_cast<size_t>(n));
      Emit(i, p, stream);
    } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
      Flush(i, p, stream);
      CloseFd(p.fd);
    }
  }

  // Reads what an ended child left in its stderr pipe, so that an error it reported is known
  // when its exit is handled.
  void DrainStderr(size_t i) {
    for (int reads = 0; reads < 64 && children_[i].err.fd >= 0; ++reads) {
      pollfd f{children_[i].err.fd, POLLIN, 0};
      if (::poll(&f, 1, 0) <= 0) return;
      ReadOnce(i, Stream::kStderr);
    }
  }

  void Emit(size_t rank, Pipe& p, Stream stream) {
    size_t begin = 0;
    for (size_t nl; (nl = p.pending.find('\n', begin)) != std::string::npos; begin = nl + 1) {
      Deliver(rank, stream, std::string_view(p.pending).substr(begin, nl - begin));
    }
    p.pending.erase(0, begin);
    if (stream == Stream::kStdout && InPlace()) {
      // What carriage returns rewrote is gone from the screen; dropping it bounds the one line
      // a progress bar writes for the whole run. The carriage return before the rest stays.
      const size_t shown =
          static_cast<size_t>(ShownOnTerminal(p.pending).data() - p.pending.data());
      if (shown > 1) p.pending.erase(0, shown - 1);
      console_.Partial(static_cast<int>(rank), p.pending);
    }
    if (p.pending.size() > kMaxLine) Flush(rank, p, stream);
  }

  // Whether ranks' in-place rewrites of their stdout line reach a terminal as they come.
  bool InPlace() const { return !options_.sink && console_.terminal(); }

  void Flush(size_t rank, Pipe& p, Stream stream) {
    if (!p.pending.empty()) Deliver(rank, stream, p.pending);
    p.pending.clear();
  }

  // Passes a line on to the sink, except a rank's error report, which is kept for the end.
  void Deliver(size_t rank, Stream stream, std::string_view line) {
    if (stream != Stream::kStderr || !line.starts_with(kRankErrorMarker)) {
      if (options_.sink) {
        options_.sink(static_cast<int>(rank), stream, line);
      } else {
        console_.Line(static_cast<int>(rank), stream, line);
      }
      return;
    }
    children_[rank].reported_error = true;
    const std::string message = Unescape(line.substr(kRankErrorMarker.size()));
    for (auto& [text, ranks] : rank_errors_) {
      if (text == message) {
        ranks.push_back(static_cast<int>(rank));
        std::sort(ranks.begin(), ranks.end());
        return;
      }
    }
    rank_errors_.emplace_back(message, std::vector<int>{static_cast<int>(rank)});
  }

  void Reap() {
    bool failed = false;
    bool reported = false;
    for (Child& c : children_) {
      if (c.reaped || ::waitpid(c.pid, &c.status, WNOHANG) != c.pid) continue;
      c.reaped = true;
      CloseFd(c.exit_fd);
      if (WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0) {
        c.stopped = stopping_;
        continue;
      }
      // A rank that ends after the stop, of the launcher's own signal or of the broken
      // connections the stop caused, was stopped; it did not fail on its own.
      c.failed_on_its_own = !stopping_ || (WIFSIGNALED(c.status) && !OurSignal(c.status));
      c.stopped = !c.failed_on_its_own;
      failed = true;
      DrainStderr(static_cast<size_t>(&c - children_.data()));
      reported = reported || c.reported_error;
    }
    if (failed && !stopping_) {
      const auto at = Clock::now() + (reported ? kReportWindow : std::chrono::milliseconds(0));
      stop_at_ = stop_at_ ? std::min(*stop_at_, at) : at;
      if (AllReaped() || Clock::now() >= *stop_at_) StopAll();
    }
  }

  bool OurSignal(int status) const {
    return WTERMSIG(status) == SIGTERM || (killed_ && WTERMSIG(status) == SIGKILL);
  }

  // The rank to name when several failed on their own: the peers of a rank that died of a
  // signal usually fail a moment later on its broken connections, and may be reaped first, so
  // a rank killed by a signal is the likelier cause; otherwise the first one reaped.
  const Child* RootCause() const {
    const Child* first = nullptr;
    for (const Child& c : children_) {
      if (!c.failed_on_its_own) continue;
      if (WIFSIGNALED(c.status)) return &c;
      if (!first) first = &c;
    }
    return first;
  }

  std::string Describe(const Child& c) const {
    return "rank " + std::to_string(&c - children_.data()) + " (pid " + std::to_string(c.pid) +
           ") " + DescribeStatus(c.status);
  }

  std::string Stopped() const {
    int n = 0;
    for (const Child& c : children_) n += c.stopped ? 1 : 0;
    return "stopped " + std::to_string(n) + " still-running rank" + (n == 1 ? "" : "s");
  }

  void StopAll() {
    stopping_ = true;
    Signal(SIGTERM);
    // A stopped rank (SIGSTOP, a debugger's) takes its SIGTERM only once continued.
    Signal(SIGCONT);
    kill_at_ = Clock::now() + options_.grace;
  }

  void Signal(int sig) {
    // A pgid is safe to signal while its leader is unreaped (a zombie still owns the id);
    // afterwards the id could be reused, so only the known, unreaped pids are signalled.
    if (pgid_ > 0 && !children_.empty() && !children_[0].reaped) ::killpg(pgid_, sig);
    for (const Child& c : children_) {
      if (!c.reaped && c.pid > 0) ::kill(c.pid, sig);
    }
  }

  bool AllReaped() const {
    for (const Child& c : children_) {
      if (!c.reaped) return false;
    }
    return true;
  }

  bool AnyFdOpen() const {
    for (const Child& c : children_) {
      if (c.out.fd >= 0 || c.err.fd >= 0) return true;
    }
    return false;
  }

  static void CloseFd(int& fd) {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }

  const LaunchOptions& options_;
  // Held until the ranks are reaped, so that no other job is handed the store's port.
  std::optional<PortReservation> reserved_port_;
  RankConsole console_;
  std::vector<Child> children_;
  std::vector<std::pair<std::string, std::vector<int>>> rank_errors_;  // message, its ranks
  pid_t pgid_ = 0;
  bool stopping_ = false;
  bool killed_ = false;  // the grace period ran out and the launcher sent SIGKILL
  std::optional<int> interrupt_;
  std::optional<Clock::time_point> stop_at_;  // when to stop the ranks after a failure
  std::optional<Clock::time_point> kill_at_;
  std::optional<Clock::time_point> drain_until_;
};

}  // namespace

std::string RankErrorLine(std::string_view message) {
  std::string line(kRankErrorMarker);
  for (char c : message) {
    if (c == '\\') {
      line += "\\\\";
    } else if (c == '\n') {
      line += "\\n";
    } else {
      line.push_back(c);
    }
  }
  return line;
}

std::string_view ShownOnTerminal(std::string_view text) {
  const size_t last = text.find_last_not_of('\r');
  if (last == std::string_view::npos) return text.substr(0, 0);
  const size_t cr = text.rfind('\r', last);
  return cr == std::string_view::npos ? text.substr(0, last + 1) : text.substr(cr + 1, last - cr);
}

RankConsole::RankConsole(bool terminal, Writer write, int columns)
    : terminal_(terminal), write_(write ? std::move(write) : WriteFd), columns_(columns) {}

// Cut to the terminal's width less its last column, so the bar never wraps: a carriage return
// goes back only to the start of the last line a wrapped one took.
std::string RankConsole::Bar() const {
  const std::string bar = RankPrefix(bar_rank_) + bar_;
  if (columns_ <= 0) return bar;
  return std::string(FitColumns(bar, static_cast<size_t>(columns_) - 1));
}

void RankConsole::Line(int rank, Stream stream, std::string_view line) {
  // Written as it is, a carriage return would send the line back over its own prefix.
  std::string text = RankPrefix(rank);
  text.append(terminal_ ? ShownOnTerminal(line) : line);
  text.push_back('\n');
  if (bar_rank_ < 0) {
    write_(stream, text);
    return;
  }
  const bool ends_bar = rank == bar_rank_ && stream == Stream::kStdout;
  const std::string clear = "\r" + std::string(kEraseToEnd);
  if (stream == Stream::kStdout) {
    write_(Stream::kStdout, clear + text + (ends_bar ? "" : Bar()));
  } else {
    write_(Stream::kStdout, clear);
    write_(Stream::kStderr, text);
    write_(Stream::kStdout, Bar());
  }
  if (ends_bar) bar_rank_ = -1;
}

void RankConsole::Partial(int rank, std::string_view text) {
  if (!terminal_ || text.find('\r') == std::string_view::npos) return;
  bar_rank_ = rank;
  bar_ = ShownOnTerminal(text);
  // Erasing after the text, not before, so the line never flickers blank.
  write_(Stream::kStdout, "\r" + Bar() + std::string(kEraseToEnd));
}

void RankConsole::Finish() {
  if (bar_rank_ < 0) return;
  write_(Stream::kStdout, "\n");
  bar_rank_ = -1;
}

int ParseNproc(std::string_view text) {
  int n = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (text.empty() || ec != std::errc() || ptr != text.data() + text.size() || n < 1) {
    throw Error(CAI_INVALID_ARGUMENT, "--nproc must be a whole number of ranks, at least 1; got '" +
                                          std::string(text) + "'");
  }
  return n;
}

void SetProgramEntry(ProgramEntry entry) { g_program_entry = entry; }

LaunchResult LaunchLocal(const LaunchOptions& options) {
  if (options.nproc < 1) {
    throw Error(CAI_INVALID_ARGUMENT,
                "--nproc must be at least 1, got " + std::to_string(options.nproc));
  }
  InterruptHandlers handlers;
  Launcher launcher(options);
  return launcher.Run();
}

int RunOrLaunch(const LaunchOptions& options, const std::function<int(const RankEnv&)>& rank_main) {
  if (std::optional<RankEnv> env = DetectRankEnv()) return rank_main(*env);
  if (options.nproc == 1) {
    RankEnv local;
    local.launcher = "local";
    local.master_addr = "127.0.0.1";
    const PortReservation port(local.master_addr);
    local.master_port = port.port();
    local.run_id = "local-" + std::to_string(::getpid());
    return rank_main(local);
  }
  LaunchResult result = LaunchLocal(options);
  std::string text;
  for (const std::string& error : result.rank_errors) text += "cai: error: " + error + "\n";
  if (result.exit_code != 0) text += "cai: error: " + result.message + "\n";
  (void)!::write(STDERR_FILENO, text.data(), text.size());
  // The launcher is done. Its static teardown (LibTorch's registries, ~0.2 s) and, under
  // AddressSanitizer, its exit's leak check (~0.5 s more in a two-rank run) would only delay the
  // command's end; its own code is leak-checked by the launcher's tests and by every one-rank
  // run, which parses, discovers and trains in one process.
  LeaveNow(result.exit_code, /*check_leaks=*/false);
}

}  // namespace cai::launch
