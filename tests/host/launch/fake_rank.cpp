// A rank for the launcher's tests: finds its rank the way `cai train` does and then behaves
// as argv[1] says.
//   ok             print a line to stdout and to stderr, exit 0
//   rank1-exits-3  rank 1 exits 3 after a moment; the others wait to be stopped
//   rank0-ignores-term-rank1-exits-1
//                  rank 0 ignores SIGTERM and hangs; rank 1 exits 1; the others wait
//   rank0-exits-1-rank1-killed
//                  rank 0 exits 1; rank 1, ignoring SIGTERM, kills itself with SIGKILL a
//                  moment later (a peer failing on a dead rank's broken connection, reaped
//                  before the dead rank)
//   errors         every rank reports an error and exits 1, rank 1 a moment after the others:
//                  ranks 0 and 2 the same two-line message, rank 1 another
//   all-wait       every rank waits to be stopped
//   bar            rank 0 prints the launcher's kStdoutTerminalVar, then rewrites a progress
//                  line in place, printing a stderr line between two rewrites; rank 1 exits 0
// Every rank writes its pid to $CAI_TEST_PID_DIR/<rank> when that is set, so tests can check
// that no process is left behind.
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "launch/local_launcher.h"
#include "launch/rank_env.h"

int main(int argc, char** argv) {
  const auto env = cai::launch::DetectRankEnv();
  if (!env || argc < 2) {
    std::fprintf(stderr, "fake_rank: no rank environment or no mode\n");
    return 2;
  }
  if (const char* dir = std::getenv("CAI_TEST_PID_DIR")) {
    std::ofstream(std::string(dir) + "/" + std::to_string(env->rank)) << ::getpid() << "\n";
  }
  const std::string mode = argv[1];
  if (mode == "ok") {
    std::printf("hello from rank %d of %d via %s, master %s:%d, run %s\n", env->rank,
                env->world_size, env->launcher.c_str(), env->master_addr.c_str(), env->master_port,
                env->run_id.c_str());
    std::fflush(stdout);
    std::fprintf(stderr, "warning from rank %d\n", env->rank);
    return 0;
  }
  if (mode == "rank1-exits-3" && env->rank == 1) {
    ::usleep(200 * 1000);
    std::printf("rank 1 giving up\n");
    return 3;
  }
  if (mode == "rank0-ignores-term-rank1-exits-1") {
    if (env->rank == 0) ::signal(SIGTERM, SIG_IGN);
    if (env->rank == 1) {
      ::usleep(200 * 1000);
      return 1;
    }
  }
  if (mode == "rank0-exits-1-rank1-killed") {
    if (env->rank == 0) {
      ::usleep(100 * 1000);  // so that rank 1 ignores SIGTERM before the launcher sends it
      return 1;
    }
    ::signal(SIGTERM, SIG_IGN);
    ::usleep(300 * 1000);
    ::raise(SIGKILL);
  }
  if (mode == "errors") {
    if (env->rank == 1) ::usleep(200 * 1000);
    const std::string line = cai::launch::RankErrorLine(
        env->rank == 1 ? "rank 1 is different" : "no such file: C:\\data.bin\nsecond line");
    std::fprintf(stderr, "%s\n", line.c_str());
    return 1;
  }
  if (mode == "bar") {
    if (env->rank != 0) return 0;
    const char* terminal = std::getenv(cai::launch::kStdoutTerminalVar);
    std::printf("tty %s\n\r[#.] 1/2", terminal ? terminal : "unset");
    std::fflush(stdout);
    // The pauses let the launcher read each piece on its own, as it would a real step's.
    ::usleep(300 * 1000);
    std::fprintf(stderr, "note from rank 0\n");
    ::usleep(300 * 1000);
    std::printf("\r[##] 2/2\n");
    return 0;
  }
  while (true) ::pause();
}
