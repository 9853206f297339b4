#include "comm/comm_api.h"

#include <chrono>
#include <span>
#include <string>

#include "comm/communicator.h"
#include "core/status.h"

namespace cai {

namespace {

Communicator& Required(const char* function) {
  Communicator* comm = Communicator::Get();
  if (comm == nullptr) {
    throw Error(CAI_FAILED_PRECONDITION,
                std::string("cai_comm_api.") + function +
                    ": the communicator is not initialised (the host rendezvous has not run)");
  }
  return *comm;
}

cai_comm_group* World() {
  Communicator* comm = Communicator::Get();
  return comm ? comm->world() : nullptr;
}

int32_t Rank(const cai_comm_group* group) {
  Communicator* comm = Communicator::Get();
  return comm ? comm->GroupRank(group) : -1;
}

int32_t Size(const cai_comm_group* group) {
  Communicator* comm = Communicator::Get();
  return comm ? comm->GroupSize(group) : 0;
}

cai_status* NewGroup(const int32_t* world_ranks, size_t count, cai_comm_group** out) {
  return Guard([&] {
    if (out == nullptr) throw Error(CAI_INVALID_ARGUMENT, "new_group: out is NULL");
    if (world_ranks == nullptr && count > 0) {
      throw Error(CAI_INVALID_ARGUMENT, "new_group: world_ranks is NULL");
    }
    *out = Required("new_group").NewGroup(std::span<const int32_t>(world_ranks, count));
  });
}

void DestroyGroup(cai_comm_group* group) {
  // A release function has no status to report through; Guard keeps exceptions inside.
  cai_status* status = Guard([&] {
    if (Communicator* comm = Communicator::Get()) comm->DestroyGroup(group);
  });
  DestroyStatus(status);
}

cai_status* Run(const cai_comm_args* args, cai_comm_work** work) {
  return Guard([&] {
    if (args == nullptr) throw Error(CAI_INVALID_ARGUMENT, "run: args is NULL");
    if (CAI_HAS_FIELD(args, cai_comm_args, async) && args->async && work == nullptr) {
      throw Error(CAI_INVALID_ARGUMENT, "run: an async operation needs a `work` out-parameter");
    }
    Communicator& comm = Required("run");
    cai_comm_work* handle = comm.Run(*args);
    if (args->async) {
      *work = handle;
      return;
    }
    // Synchronous: the operation has completed (or failed) when run returns.
    struct Releaser {
      cai_comm_work* w;
      ~Releaser() { Communicator::Release(w); }
    } releaser{handle};
    Communicator::Wait(handle, std::chrono::milliseconds(0));
    if (work != nullptr) *work = nullptr;
  });
}

cai_status* WorkWait(cai_comm_work* work, int64_t timeout_ms) {
  return Guard([&] {
    if (timeout_ms < 0) throw Error(CAI_INVALID_ARGUMENT, "work_wait: timeout_ms is negative");
    Communicator::Wait(work, std::chrono::milliseconds(timeout_ms));
  });
}

bool WorkIsCompleted(cai_comm_work* work) { return Communicator::IsCompleted(work); }

void WorkRelease(cai_comm_work* work) { Communicator::Release(work); }

cai_status* GetCounters(const cai_comm_group* group, cai_comm_counters* out) {
  return Guard([&] {
    RequireStructSize(out, CAI_STRUCT_SIZE(cai_comm_counters, bytes), "counters: out");
    cai_comm_counters counters = Required("counters").Counters(group);
    for (int i = 0; i < CAI_COMM_NUM_OPS; ++i) {
      out->calls[i] = counters.calls[i];
      out->bytes[i] = counters.bytes[i];
    }
  });
}

void ResetCounters() {
  if (Communicator* comm = Communicator::Get()) comm->ResetCounters();
}

const char* BackendInfo(const cai_comm_group* group) {
  Communicator* comm = Communicator::Get();
  return comm ? comm->BackendInfo(group) : "not initialised";
}

}  // namespace

const cai_comm_api* CommApi() {
  static const cai_comm_api api = {
      CAI_COMM_API_STRUCT_SIZE,
      nullptr,
      &World,
      &Rank,
      &Size,
      &NewGroup,
      &DestroyGroup,
      &Run,
      &WorkWait,
      &WorkIsCompleted,
      &WorkRelease,
      &GetCounters,
      &ResetCounters,
      &BackendInfo,
  };
  return &api;
}

}  // namespace cai
