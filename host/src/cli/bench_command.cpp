#include "cli/bench_command.h"

#include <exception>
#include <iostream>
#include <string>

#include "comm/comm_bench.h"
#include "comm/communicator.h"
#include "core/log.h"
#include "core/status.h"
#include "launch/local_launcher.h"

namespace cai {
namespace {

constexpr const char* kUsage =
    "usage: cai bench comm [--nproc N] [--min-bytes B] [--max-bytes B] [--factor F] [--lanes L]\n"
    "                      [--transport auto|tcp]\n"
    "  Times every collective over sizes from --min-bytes (default 4K) to --max-bytes (256M),\n"
    "  multiplying by --factor (4), on N ranks (2) of this machine or as the rank the\n"
    "  environment names (torchrun / SLURM / Open MPI variables), and prints nccl-tests'\n"
    "  table: time, algorithm bandwidth and bus bandwidth (all_gather also in place). Before\n"
    "  and after it, on plain TCP connections of its own around the ring: the bound (every rank\n"
    "  sending and receiving at once, how busy that keeps each rank) and the plain ring's\n"
    "  reduce_scatter and all_gather; with shared memory also its bound (every rank copying\n"
    "  into its outbox and out of its neighbour's); the summary holds each op at >= 64 MiB\n"
    "  against them.\n"
    "  Sizes take K, M or G suffixes.\n"
    "  --lanes: connections per peer that large collectives are split over (launch.comm_lanes,\n"
    "  default 2).\n"
    "  --transport: auto (default) sends all_reduce, reduce_scatter and all_gather through\n"
    "  shared memory between ranks of one host, tcp over the connections\n"
    "  (launch.comm_transport).\n";

size_t ParseBytes(const std::string& text) {
  size_t pos = 0;
  size_t value = 0;
  try {
    value = std::stoull(text, &pos);
  } catch (const std::exception&) {
    throw Error(CAI_INVALID_ARGUMENT, "'" + text + "' is not a size (e.g. 4K, 64M)");
  }
  const std::string unit = text.substr(pos);
  if (unit.empty()) return value;
  if (unit == "K" || unit == "KiB") return value << 10;
  if (unit == "M" || unit == "MiB") return value << 20;
  if (unit == "G" || unit == "GiB") return value << 30;
  throw Error(CAI_INVALID_ARGUMENT,
              "unknown size unit '" + unit + "' in '" + text + "' (use K, M or G)");
}

}  // namespace

int RunBenchCommand(const GlobalOptions&, std::span<const std::string> args) {
  if (args.empty() || args[0] != "comm") {
    throw Error(CAI_INVALID_ARGUMENT, std::string("cai bench takes 'comm'\n") + kUsage);
  }
  launch::LaunchOptions launch;
  launch.nproc = 2;
  CommBenchOptions bench;
  int lanes = CommOptions{}.lanes;
  bool shared_memory = CommOptions{}.shared_memory;
  launch.args = {"bench", "comm"};
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if (i + 1 >= args.size()) throw Error(CAI_INVALID_ARGUMENT, a + " needs a value\n" + kUsage);
    const std::string& value = args[++i];
    if (a == "--nproc") {
      launch.nproc = launch::ParseNproc(value);
      continue;
    } else if (a == "--min-bytes") {
      bench.min_bytes = ParseBytes(value);
    } else if (a == "--max-bytes") {
      bench.max_bytes = ParseBytes(value);
    } else if (a == "--lanes") {
      size_t pos = 0;
      try {
        lanes = std::stoi(value, &pos);
      } catch (const std::exception&) {
        pos = 0;
      }
      if (pos != value.size() || lanes < 1 || lanes > 16) {
        throw Error(CAI_INVALID_ARGUMENT,
                    "--lanes takes a whole number from 1 to 16, not '" + value + "'");
      }
    } else if (a == "--transport") {
      if (value != "auto" && value != "tcp") {
        throw Error(CAI_INVALID_ARGUMENT, "--transport takes auto or tcp, not '" + value + "'");
      }
      shared_memory = value == "auto";
    } else if (a == "--factor") {
      bench.factor = ParseBytes(value);
      if (bench.factor < 2) throw Error(CAI_INVALID_ARGUMENT, "--factor must be at least 2");
    } else {
      throw Error(CAI_INVALID_ARGUMENT, "unknown option '" + a + "'\n" + kUsage);
    }
    launch.args.push_back(a);
    launch.args.push_back(value);
  }
  if (bench.min_bytes == 0 || bench.min_bytes > bench.max_bytes) {
    throw Error(CAI_INVALID_ARGUMENT, "--min-bytes must be positive and at most --max-bytes");
  }
  launch.env.emplace_back("CAI_LAUNCHER", "local");
  return launch::RunOrLaunch(launch, [&](const launch::RankEnv& env) {
    InitLogging(env.rank, CAI_LOG_WARN, std::getenv("CAI_LAUNCHER") == nullptr);
    CommOptions comm;
    comm.rank = env.rank;
    comm.world_size = env.world_size;
    comm.master_addr = env.master_addr;
    comm.master_port = env.master_port;
    comm.lanes = lanes;
    comm.shared_memory = shared_memory;
    Communicator::Init(comm);
    const int code = RunCommBenchmark(bench, std::cout);
    Communicator::Shutdown();
    return code;
  });
}

}  // namespace cai
