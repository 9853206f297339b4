// `cai train --nproc N`: runs N ranks of one program on this machine, the way torchrun does,
// and makes sure they live and die together.
//
// Each rank is a child process with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT and CAI_RUN_ID set, so DetectRankEnv() in the child finds its rank.
// A rank of another program is fork + execve. A rank of this program, when it has registered
// its entry (SetProgramEntry) and the launcher runs no other thread, is a fork that calls the
// entry with the rank's arguments and environment, as the program's main would be called,
// without executing the program again: a rank then starts with its libraries loaded and
// initialised, which for LibTorch is ~0.65 s and as much CPU time per rank on a 2-core machine.
// What exec would have done to the launcher's state, the fork does: the launcher's descriptors
// are closed and its signal handlers reset. The children share one new process group (so a signal
// to the group also reaches anything they spawned) and carry PR_SET_PDEATHSIG(SIGKILL), so they die
// if the launcher dies, even by SIGKILL. Their stdout and stderr come back through pipes and reach
// the sink line by line, tagged with the rank; where the launcher's stdout is a terminal, a rank's
// line rewritten in place (a progress bar) reaches it as it changes (RankConsole).
//
// A rank that fails reports its error as one stderr line, RankErrorLine(message); the launcher
// holds these lines back and, once the ranks have ended, reports each distinct message once
// with the ranks that hit it ("ranks 0,1: ..."), before its own summary, instead of N copies.
//
// If a rank exits non-zero or is killed by a signal, or the launcher gets SIGINT, SIGTERM or
// SIGHUP, every other rank gets SIGTERM (and SIGCONT, so a stopped rank takes it) and,
// `grace` later, SIGKILL; the launcher returns
// once all are reaped. A rank that hangs while its peer is dead is thus gone within
// grace + 0.1 s of the death, well within the 60 s a user waits for a failed job to end.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "launch/rank_env.h"

namespace cai::launch {

enum class Stream { kStdout, kStderr };

// Receives each line a rank printed, without its newline. Called on the launcher's thread.
using LineSink = std::function<void(int rank, Stream stream, std::string_view line)>;

// Set in every rank's environment: "1" where the launcher's stdout is a terminal and a rank's
// in-place rewrites of its stdout line reach it as they come (RankConsole), "0" elsewhere.
inline constexpr char kStdoutTerminalVar[] = "CAI_STDOUT_TTY";
// Set with it where the terminal tells its width: the columns a rank's line has after the
// launcher's "[rank N] " prefix.
inline constexpr char kStdoutColumnsVar[] = "CAI_STDOUT_COLUMNS";

// What a terminal shows of `text` once its carriage returns have rewritten the line: the part
// after the last carriage return that text follows ("\r[#.] step 1\r[##] step 2" shows
// "[##] step 2", "step 3\r" shows "step 3"); all of `text` when it has none. A part of `text`.
std::string_view ShownOnTerminal(std::string_view text);

// Where the ranks' output goes unless LaunchOptions::sink says otherwise: the launcher's stdout
// and stderr, "[rank R] line\n" per line, each line in one write() so that lines of different
// ranks never interleave mid-line. On a terminal, a rank's stdout line that carriage returns
// rewrite in place (rank 0's progress bar) is shown as it changes, "\r[rank R] text", before its
// newline comes; a line arriving meanwhile, of any rank or stream, takes the bar's place and the
// bar is drawn again below it, so the bar stays the last line. Not thread-safe.
class RankConsole {
 public:
  // Writes text to the launcher's stdout or stderr.
  using Writer = std::function<void(Stream stream, std::string_view text)>;
  // `write` empty: the launcher's own stdout and stderr. `columns` > 0: the terminal's width,
  // which a bar is cut to.
  explicit RankConsole(bool terminal, Writer write = {}, int columns = 0);

  bool terminal() const { return terminal_; }
  // A line a rank printed, without its newline; on a terminal, what the terminal would show of it.
  void Line(int rank, Stream stream, std::string_view line);
  // What a rank has written to stdout since its last newline. Shown at once on a terminal when
  // it holds a carriage return; it otherwise waits for its newline, like any line.
  void Partial(int rank, std::string_view text);
  // Ends a bar still shown with a newline, so that what is written next has a line of its own.
  void Finish();

 private:
  std::string Bar() const;

  bool terminal_;
  Writer write_;
  int columns_;
  int bar_rank_ = -1;  // -1: no bar shown
  std::string bar_;
};

struct LaunchOptions {
  int nproc = 0;
  std::filesystem::path executable;  // empty: this process's own executable
  std::vector<std::string> args;     // argv[1...] of every rank
  // Set in every rank's environment on top of the launcher's own.
  std::vector<std::pair<std::string, std::string>> env;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;                     // 0: a free port, held until the ranks end
  std::chrono::milliseconds grace{10000};  // from SIGTERM to SIGKILL
  LineSink sink;  // empty: a RankConsole on the launcher's stdout and stderr
};

// What a launched rank writes to stderr for its error: a marker and `message` on one line
// (backslashes and newlines escaped), without the final newline.
inline constexpr std::string_view kRankErrorMarker = "cai: rank error: ";
std::string RankErrorLine(std::string_view message);

struct LaunchResult {
  // 0 when every rank exited 0. Otherwise what the launcher should exit with: the failed
  // rank's exit status, or 128 + signal number when it (or the launcher) was signalled.
  int exit_code = 0;
  // Empty on success; else names the rank that failed (of those that failed before the
  // launcher stopped the rest, one killed by a signal, else the first), its pid and exit
  // status or signal, any other rank that failed on its own, and how many ranks were stopped.
  std::string message;
  // The errors ranks reported (RankErrorLine), each distinct message once, in the order of the
  // first rank that reported it: "rank 1: <message>" or "ranks 0,2: <message>".
  std::vector<std::string> rank_errors;
  std::vector<pid_t> pids;         // by rank
  std::vector<int> wait_statuses;  // by rank, as waitpid() reported them
};

// The program's main, registered by it, so that ranks of its own executable are started
// without executing it again (see the top of this file).
using ProgramEntry = int (*)(int argc, char** argv);
void SetProgramEntry(ProgramEntry entry);

// Parses the value of --nproc. Throws cai::Error (INVALID_ARGUMENT) unless it is an integer
// >= 1.
int ParseNproc(std::string_view text);

// Runs the ranks and returns when all have ended. Throws cai::Error (INVALID_ARGUMENT) for
// nproc < 1, and for failures to start (no executable, no free port, fork failure) after
// stopping any rank already started. Installs handlers for SIGINT, SIGTERM and SIGHUP for its
// duration and restores the previous ones. Call it from the main thread: the children's
// death signal fires when the thread that forked them exits.
LaunchResult LaunchLocal(const LaunchOptions& options);

// The one way a cai command becomes ranks: when the environment names a rank (torchrun,
// SLURM, Open MPI variables) it runs `rank_main` as that rank; with options.nproc == 1 it runs
// `rank_main` as the only rank of a one-process world (free loopback port, run id from the
// pid); otherwise it launches options.nproc copies of the program with options.args, which
// then take the first path. Returns the exit status of the first two paths. The launcher does
// not return: once the ranks have ended it prints a failed launch's rank errors
// (LaunchResult::rank_errors) and then its message, each line "cai: error: ...", and ends the
// process with the launch's exit status, skipping its static teardown (and, under
// AddressSanitizer, its exit's leak check).
int RunOrLaunch(const LaunchOptions& options, const std::function<int(const RankEnv&)>& rank_main);

}  // namespace cai::launch
