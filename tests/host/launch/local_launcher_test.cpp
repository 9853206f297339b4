#include "launch/local_launcher.h"

#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <ostream>
#include <set>
#include <thread>

#include "core/status.h"

namespace cai::launch {
namespace {

namespace fs = std::filesystem;
using std::chrono::seconds;
using Clock = std::chrono::steady_clock;

struct Line {
  int rank;
  Stream stream;
  std::string text;
};

LaunchOptions Fake(int nproc, const std::string& mode, std::vector<Line>* lines) {
  LaunchOptions options;
  options.nproc = nproc;
  options.executable = CAI_FAKE_RANK;
  options.args = {mode};
  options.grace = std::chrono::milliseconds(1000);
  options.sink = [lines](int rank, Stream stream, std::string_view text) {
    lines->push_back({rank, stream, std::string(text)});
  };
  return options;
}

// A process is gone when kill(pid, 0) fails, or when it is a zombie whose new parent (init,
// outside our control) has not reaped it yet.
bool Gone(pid_t pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string field;
  for (int i = 0; i < 3 && stat >> field; ++i) {
  }
  return field == "Z";
}

void ExpectAllGone(const std::vector<pid_t>& pids) {
  for (pid_t pid : pids) EXPECT_TRUE(Gone(pid)) << "pid " << pid << " is still running";
}

class PidDir {
 public:
  PidDir() : path_(fs::temp_directory_path() / ("cai_launch_test_" + std::to_string(::getpid()))) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~PidDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }
  std::vector<pid_t> Pids() const {
    std::vector<pid_t> pids;
    for (const auto& e : fs::directory_iterator(path_)) {
      pid_t pid = 0;
      if (std::ifstream(e.path()) >> pid) pids.push_back(pid);
    }
    return pids;
  }

 private:
  fs::path path_;
};

TEST(LaunchLocal, ThreeRanksSucceed_ExitZeroAndEveryLineCarriesItsRank) {
  std::vector<Line> lines;
  const LaunchResult result = LaunchLocal(Fake(3, "ok", &lines));
  EXPECT_EQ(result.exit_code, 0);
  EXPECT_EQ(result.message, "");
  ASSERT_EQ(result.pids.size(), 3u);
  ASSERT_EQ(lines.size(), 6u);
  std::string port_and_run;
  for (int rank = 0; rank < 3; ++rank) {
    int out = 0, err = 0;
    for (const Line& line : lines) {
      if (line.rank != rank) continue;
      if (line.stream == Stream::kStdout) {
        ++out;
        const std::string head =
            "hello from rank " + std::to_string(rank) + " of 3 via torchrun, master 127.0.0.1:";
        ASSERT_TRUE(line.text.starts_with(head)) << line.text;
        // Every rank got the same port and run id.
        if (port_and_run.empty()) port_and_run = line.text.substr(head.size());
        EXPECT_EQ(line.text.substr(head.size()), port_and_run);
      } else {
        ++err;
        EXPECT_EQ(line.text, "warning from rank " + std::to_string(rank));
      }
    }
    EXPECT_EQ(out, 1) << "rank " << rank;
    EXPECT_EQ(err, 1) << "rank " << rank;
  }
  EXPECT_NE(port_and_run.find(", run local-"), std::string::npos) << port_and_run;
  ExpectAllGone(result.pids);
}

// Runs LaunchLocal(mode) with the default sink in a child whose stdout and stderr are
// `terminal` (a pseudo-terminal in raw mode, so that what is written arrives unchanged) or a
// pipe; returns what the child wrote there once the launcher has ended.
std::string DefaultSinkOutput(const std::string& mode, bool terminal) {
  int read_fd = -1, write_fd = -1;
  if (terminal) {
    read_fd = ::posix_openpt(O_RDWR | O_NOCTTY);
    EXPECT_GE(read_fd, 0);
    EXPECT_EQ(::grantpt(read_fd), 0);
    EXPECT_EQ(::unlockpt(read_fd), 0);
    write_fd = ::open(::ptsname(read_fd), O_RDWR | O_NOCTTY);
    termios raw{};
    ::tcgetattr(write_fd, &raw);
    ::cfmakeraw(&raw);
    ::tcsetattr(write_fd, TCSANOW, &raw);
  } else {
    int fds[2];
    EXPECT_EQ(::pipe(fds), 0);
    read_fd = fds[0];
    write_fd = fds[1];
  }
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(write_fd, STDOUT_FILENO);
    ::dup2(write_fd, STDERR_FILENO);
    ::close(read_fd);
    LaunchOptions options;
    options.nproc = 2;
    options.executable = CAI_FAKE_RANK;
    options.args = {mode};
    ::_exit(LaunchLocal(options).exit_code);
  }
  ::close(write_fd);
  std::string output;
  char buffer[4096];
  // A pseudo-terminal's reader gets EIO, not 0, once every writer has closed it.
  for (ssize_t n; (n = ::read(read_fd, buffer, sizeof(buffer))) > 0;) output.append(buffer, n);
  ::close(read_fd);
  int status = 0;
  ::waitpid(pid, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << output;
  return output;
}

TEST(LaunchLocal, DefaultSink_PrefixesLinesWithRank) {
  const std::string output = DefaultSinkOutput("ok", false);
  EXPECT_NE(output.find("[rank 0] hello from rank 0 of 2"), std::string::npos) << output;
  EXPECT_NE(output.find("[rank 1] hello from rank 1 of 2"), std::string::npos) << output;
}

// Not on a terminal, a line rewritten in place is passed on when its newline comes, as written.
TEST(LaunchLocal, DefaultSinkToAPipe_PassesARewrittenLineWholeAtItsNewline) {
  const std::string output = DefaultSinkOutput("bar", false);
  EXPECT_NE(output.find("[rank 0] tty 0\n"), std::string::npos) << output;
  EXPECT_NE(output.find("[rank 0] note from rank 0\n"), std::string::npos) << output;
  EXPECT_NE(output.find("[rank 0] \r[#.] 1/2\r[##] 2/2\n"), std::string::npos) << output;
  EXPECT_EQ(output.find('\033'), std::string::npos) << output;
}

// On a terminal the ranks learn it, and rank 0's bar shows before its newline, stays below a line
// printed meanwhile, and ends as the line a terminal would show.
TEST(LaunchLocal, DefaultSinkToATerminal_ShowsTheBarAsItChangesBelowOtherLines) {
  const std::string output = DefaultSinkOutput("bar", true);
  EXPECT_NE(output.find("[rank 0] tty 1\n"), std::string::npos) << output;
  EXPECT_NE(output.find("\r[rank 0] [#.] 1/2\033[K"), std::string::npos) << output;
  EXPECT_NE(output.find("\r\033[K[rank 0] note from rank 0\n[rank 0] [#.] 1/2"), std::string::npos)
      << output;
  EXPECT_TRUE(output.ends_with("\r\033[K[rank 0] [##] 2/2\n")) << output;
}

TEST(ShownOnTerminal, IsWhatTheLastCarriageReturnLeft) {
  EXPECT_EQ(ShownOnTerminal("plain"), "plain");
  EXPECT_EQ(ShownOnTerminal("\r[#.] 1/2\r[##] 2/2"), "[##] 2/2");
  EXPECT_EQ(ShownOnTerminal("[#.] 1/2\r[##] 2/2\r"), "[##] 2/2");
  EXPECT_EQ(ShownOnTerminal("windows\r"), "windows");
  EXPECT_EQ(ShownOnTerminal("\r\r"), "");
  EXPECT_EQ(ShownOnTerminal(""), "");
}

struct Written {
  Stream stream;
  std::string text;
  bool operator==(const Written&) const = default;
};

void PrintTo(const Written& w, std::ostream* os) {
  *os << (w.stream == Stream::kStdout ? "out:" : "err:") << ::testing::PrintToString(w.text);
}

RankConsole Recording(bool terminal, std::vector<Written>* written, int columns = 0) {
  return RankConsole(
      terminal,
      [written](Stream stream, std::string_view text) {
        written->push_back({stream, std::string(text)});
      },
      columns);
}

TEST(RankConsole, OnATerminal_OtherLinesTakeTheBarsPlaceAndTheBarIsDrawnBelow) {
  std::vector<Written> w;
  RankConsole console = Recording(true, &w);
  console.Partial(0, "no carriage return yet");
  EXPECT_TRUE(w.empty());
  console.Partial(0, "\r[#...] 1/4");
  console.Line(1, Stream::kStdout, "rank 1 says");
  console.Line(0, Stream::kStderr, "a warning");
  console.Partial(0, "\r[##..] 2/4");
  console.Line(0, Stream::kStdout, "\r[####] 4/4   ");
  console.Line(1, Stream::kStdout, "after the bar");
  console.Finish();
  const std::vector<Written> expected{
      {Stream::kStdout, "\r[rank 0] [#...] 1/4\033[K"},
      {Stream::kStdout, "\r\033[K[rank 1] rank 1 says\n[rank 0] [#...] 1/4"},
      {Stream::kStdout, "\r\033[K"},
      {Stream::kStderr, "[rank 0] a warning\n"},
      {Stream::kStdout, "[rank 0] [#...] 1/4"},
      {Stream::kStdout, "\r[rank 0] [##..] 2/4\033[K"},
      {Stream::kStdout, "\r\033[K[rank 0] [####] 4/4   \n"},
      {Stream::kStdout, "[rank 1] after the bar\n"},
  };
  EXPECT_EQ(w, expected);
}

TEST(RankConsole, OnATerminal_FinishEndsABarLeftShowing) {
  std::vector<Written> w;
  RankConsole console = Recording(true, &w);
  console.Partial(0, "\r[#.] 1/2");
  console.Finish();
  console.Finish();
  const std::vector<Written> expected{{Stream::kStdout, "\r[rank 0] [#.] 1/2\033[K"},
                                      {Stream::kStdout, "\n"}};
  EXPECT_EQ(w, expected);
}

// The prefix makes a rank's bar wider than the rank knew: cut short of the last column, at a
// character boundary, so that it never wraps.
TEST(RankConsole, OnANarrowTerminal_TheBarIsCutToItsWidth) {
  std::vector<Written> w;
  RankConsole console = Recording(true, &w, 16);
  console.Partial(0, "\r[#.] MFU – ETA 5s");
  const std::vector<Written> expected{{Stream::kStdout, "\r[rank 0] [#.] M\033[K"}};
  EXPECT_EQ(w, expected);
  w.clear();
  console.Partial(0, "\r[#.] –– ETA");
  EXPECT_EQ(w.at(0).text, "\r[rank 0] [#.] –\033[K");
}

TEST(RankConsole, NotATerminal_LinesPassAsWrittenAndPartialTextWaits) {
  std::vector<Written> w;
  RankConsole console = Recording(false, &w);
  console.Partial(0, "\r[#.] 1/2");
  console.Line(0, Stream::kStdout, "\r[#.] 1/2\r[##] 2/2");
  console.Finish();
  const std::vector<Written> expected{{Stream::kStdout, "[rank 0] \r[#.] 1/2\r[##] 2/2\n"}};
  EXPECT_EQ(w, expected);
}

TEST(LaunchLocal, OneRankExitsThree_LauncherFailsFastNamingItAndLeavesNoProcess) {
  PidDir pid_dir;
  std::vector<Line> lines;
  LaunchOptions options = Fake(3, "rank1-exits-3", &lines);
  options.env = {{"CAI_TEST_PID_DIR", pid_dir.path().string()}};
  const auto start = Clock::now();
  const LaunchResult result = LaunchLocal(options);
  EXPECT_LT(Clock::now() - start, seconds(60));
  EXPECT_EQ(result.exit_code, 3);
  EXPECT_NE(result.message.find("rank 1 (pid " + std::to_string(result.pids[1]) +
                                ") exited with status 3"),
            std::string::npos)
      << result.message;
  EXPECT_NE(result.message.find("stopped 2 still-running ranks"), std::string::npos)
      << result.message;
  EXPECT_TRUE(WIFSIGNALED(result.wait_statuses[0]));
  EXPECT_EQ(WTERMSIG(result.wait_statuses[0]), SIGTERM);
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_EQ(lines[0].rank, 1);
  EXPECT_EQ(lines[0].text, "rank 1 giving up");
  ExpectAllGone(result.pids);
  ExpectAllGone(pid_dir.Pids());
  EXPECT_EQ(pid_dir.Pids().size(), 3u);
}

TEST(LaunchLocal, RanksReportingErrors_EachMessageOnceWithTheRanksThatHitIt) {
  std::vector<Line> lines;
  const LaunchResult result = LaunchLocal(Fake(3, "errors", &lines));
  EXPECT_EQ(result.exit_code, 1);
  // Rank 1 fails 200 ms after the others, within the window the launcher leaves before it
  // stops the rest, so its own error is heard too.
  EXPECT_EQ(result.rank_errors,
            (std::vector<std::string>{"ranks 0,2: no such file: C:\\data.bin\nsecond line",
                                      "rank 1: rank 1 is different"}));
  EXPECT_TRUE(lines.empty()) << "the reports reached the sink: " << lines[0].text;
  EXPECT_NE(result.message.find("also rank"), std::string::npos) << result.message;
}

TEST(LaunchLocal, RankIgnoringSigtermWithDeadPeer_IsKilledAfterGrace) {
  std::vector<Line> lines;
  const auto start = Clock::now();
  const LaunchResult result = LaunchLocal(Fake(3, "rank0-ignores-term-rank1-exits-1", &lines));
  const auto elapsed = Clock::now() - start;
  EXPECT_LT(elapsed, seconds(60));
  EXPECT_GE(elapsed, std::chrono::milliseconds(1000));  // the grace period was honoured
  EXPECT_EQ(result.exit_code, 1);
  EXPECT_NE(result.message.find("rank 1 "), std::string::npos) << result.message;
  EXPECT_NE(result.message.find("exited with status 1"), std::string::npos) << result.message;
  ASSERT_TRUE(WIFSIGNALED(result.wait_statuses[0]));
  EXPECT_EQ(WTERMSIG(result.wait_statuses[0]), SIGKILL);
  EXPECT_EQ(WTERMSIG(result.wait_statuses[2]), SIGTERM);
  ExpectAllGone(result.pids);
}

TEST(LaunchLocal, RankKilledBySignal_IsNamedBeforeAPeerThatExitedFirst) {
  std::vector<Line> lines;
  const LaunchResult result = LaunchLocal(Fake(2, "rank0-exits-1-rank1-killed", &lines));
  EXPECT_EQ(result.exit_code, 128 + SIGKILL);
  EXPECT_TRUE(result.message.starts_with("rank 1 (pid " + std::to_string(result.pids[1]) +
                                         ") was killed by signal 9 (SIGKILL); also rank 0 (pid " +
                                         std::to_string(result.pids[0]) +
                                         ") exited with status 1; stopped 0 still-running ranks"))
      << result.message;
  ExpectAllGone(result.pids);
}

TEST(LaunchLocal, NprocBelowOne_IsAClearError) {
  std::vector<Line> lines;
  for (int n : {0, -2}) {
    try {
      LaunchLocal(Fake(n, "ok", &lines));
      ADD_FAILURE() << "launched " << n << " ranks";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), CAI_INVALID_ARGUMENT);
      EXPECT_EQ(std::string(e.what()), "--nproc must be at least 1, got " + std::to_string(n));
    }
  }
  EXPECT_EQ(ParseNproc("4"), 4);
  for (const char* bad : {"0", "-1", "two", "", "3x"}) {
    try {
      ParseNproc(bad);
      ADD_FAILURE() << "parsed '" << bad << "'";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--nproc must be a whole number of ranks, at least 1"),
                std::string::npos);
    }
  }
}

// Runs LaunchLocal(all-wait) in a child process; returns its pid once every rank is up.
pid_t StartLauncherProcess(const PidDir& pid_dir, int nproc) {
  const pid_t launcher = ::fork();
  if (launcher == 0) {
    LaunchOptions options;
    options.nproc = nproc;
    options.executable = CAI_FAKE_RANK;
    options.args = {"all-wait"};
    options.grace = std::chrono::milliseconds(1000);
    options.env = {{"CAI_TEST_PID_DIR", pid_dir.path().string()}};
    options.sink = [](int, Stream, std::string_view) {};
    ::_exit(LaunchLocal(options).exit_code);
  }
  const auto deadline = Clock::now() + seconds(20);
  while (pid_dir.Pids().size() < static_cast<size_t>(nproc) && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return launcher;
}

TEST(LaunchLocal, LauncherKilledBySigkill_ItsRanksDieWithIt) {
  PidDir pid_dir;
  const pid_t launcher = StartLauncherProcess(pid_dir, 2);
  ASSERT_GT(launcher, 0);
  const std::vector<pid_t> ranks = pid_dir.Pids();
  ASSERT_EQ(ranks.size(), 2u);
  ::kill(launcher, SIGKILL);
  ::waitpid(launcher, nullptr, 0);
  const auto deadline = Clock::now() + seconds(10);
  bool all_gone = false;
  while (!all_gone && Clock::now() < deadline) {
    all_gone = Gone(ranks[0]) && Gone(ranks[1]);
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(all_gone);
}

TEST(LaunchLocal, LauncherGetsSigterm_StopsRanksAndExits143) {
  PidDir pid_dir;
  const pid_t launcher = StartLauncherProcess(pid_dir, 2);
  ASSERT_GT(launcher, 0);
  const std::vector<pid_t> ranks = pid_dir.Pids();
  ASSERT_EQ(ranks.size(), 2u);
  ::kill(launcher, SIGTERM);
  int status = 0;
  ::waitpid(launcher, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGTERM);
  // The launcher reaped its ranks before exiting, so they are gone for good.
  ExpectAllGone(ranks);
}

// The descriptors open in this process, but for the one listing them.
std::set<int> OpenFds() {
  std::set<int> fds;
  DIR* dir = ::opendir("/proc/self/fd");
  if (!dir) return fds;
  while (const dirent* e = ::readdir(dir)) {
    const int fd = std::atoi(e->d_name);
    if (e->d_name[0] != '.' && fd != ::dirfd(dir)) fds.insert(fd);
  }
  ::closedir(dir);
  return fds;
}

std::set<int> g_fds_before_launch;

// The program entry of the test below: a rank of it reports what it was started with.
int ProbeProgram(int argc, char** argv) {
  std::string leaked;
  for (int fd : OpenFds()) {
    if (fd > STDERR_FILENO && !g_fds_before_launch.count(fd)) leaked += " " + std::to_string(fd);
  }
  std::string handlers = "default";
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction action {};
    ::sigaction(sig, nullptr, &action);
    if (action.sa_handler != SIG_DFL) handlers = "launcher's";
  }
  std::printf("rank %s of %s: argc %d, %s; leaked fds:%s; handlers %s\n", std::getenv("RANK"),
              std::getenv("WORLD_SIZE"), argc, argc > 1 ? argv[1] : "", leaked.c_str(),
              handlers.c_str());
  return 0;
}

TEST(LaunchLocal, RanksOfThisProgram_RunItsEntryWithTheirEnvironmentAndNoneOfTheLaunchersState) {
  // The launcher forks its own program's ranks without exec only while it runs one thread.
  ASSERT_EQ(std::distance(fs::directory_iterator("/proc/self/task"), fs::directory_iterator()), 1);
  g_fds_before_launch = OpenFds();
  SetProgramEntry(&ProbeProgram);
  std::vector<Line> lines;
  LaunchOptions options = Fake(3, "probe", &lines);
  options.executable.clear();
  const LaunchResult result = LaunchLocal(options);
  SetProgramEntry(nullptr);
  EXPECT_EQ(result.exit_code, 0) << result.message;
  std::set<std::string> seen;
  for (const Line& line : lines) {
    EXPECT_EQ(line.stream, Stream::kStdout) << line.text;
    seen.insert(line.text);
  }
  // Their own pipes, the others' and the port the launcher holds stay the launcher's; an exec
  // of this test program would have printed gtest's output instead.
  for (int rank = 0; rank < 3; ++rank) {
    const std::string expected =
        "rank " + std::to_string(rank) + " of 3: argc 2, probe; leaked fds:; handlers default";
    EXPECT_TRUE(seen.count(expected)) << "missing: " << expected;
  }
  ExpectAllGone(result.pids);
}

}  // namespace
}  // namespace cai::launch
