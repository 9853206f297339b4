#include "comm/nccl_backend.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <vector>

#include "comm/store.h"
#include "core/status.h"

namespace cai::comm {

namespace {

void Check(ncclResult_t result, const char* what) {
  if (result != ncclSuccess) {
    throw Error(result == ncclInvalidArgument || result == ncclInvalidUsage ? CAI_INVALID_ARGUMENT
                                                                            : CAI_INTERNAL,
                std::string(what) + " failed: " + ncclGetErrorString(result));
  }
}

void Check(cudaError_t result, const char* what) {
  if (result != cudaSuccess) {
    throw Error(CAI_INTERNAL, std::string(what) + " failed: " + cudaGetErrorString(result));
  }
}

ncclDataType_t ToNccl(cai_dtype d) {
  if (d.lanes == 1) {
    if (d.code == CAI_DTYPE_FLOAT && d.bits == 32) return ncclFloat32;
    if (d.code == CAI_DTYPE_FLOAT && d.bits == 64) return ncclFloat64;
    if (d.code == CAI_DTYPE_FLOAT && d.bits == 16) return ncclFloat16;
    if (d.code == CAI_DTYPE_BFLOAT && d.bits == 16) return ncclBfloat16;
    if (d.code == CAI_DTYPE_INT && d.bits == 32) return ncclInt32;
    if (d.code == CAI_DTYPE_INT && d.bits == 64) return ncclInt64;
    if (d.code == CAI_DTYPE_UINT && d.bits == 8) return ncclUint8;
  }
  throw Error(CAI_INVALID_ARGUMENT, "nccl: unsupported dtype code " + std::to_string(d.code) +
                                        " bits " + std::to_string(d.bits));
}

size_t ElementSize(cai_dtype d) { return d.bits / 8; }

ncclRedOp_t ToNccl(cai_reduce_op op) {
  switch (op) {
    case CAI_REDUCE_SUM:
      return ncclSum;
    case CAI_REDUCE_AVG:
      return ncclAvg;
    case CAI_REDUCE_MAX:
      return ncclMax;
    case CAI_REDUCE_MIN:
      return ncclMin;
    case CAI_REDUCE_PRODUCT:
      return ncclProd;
  }
  throw Error(CAI_INVALID_ARGUMENT, "nccl: unknown reduce op " + std::to_string(op));
}

cudaStream_t Stream(void* stream) { return static_cast<cudaStream_t>(stream); }

}  // namespace

struct NcclCommunicator::State {
  ncclComm_t comm = nullptr;
  int size = 0;
};

NcclCommunicator::NcclCommunicator(Store& store, const std::string& key, int rank, int size,
                                   int device, std::chrono::milliseconds timeout)
    : state_(new State) {
  try {
    state_->size = size;
    ncclUniqueId id;
    const std::string id_key = "cai/nccl/" + key;
    if (rank == 0) {
      Check(ncclGetUniqueId(&id), "ncclGetUniqueId");
      store.set(id_key, std::vector<char>(id.internal, id.internal + sizeof(id.internal)));
    } else {
      store.wait({id_key}, timeout);
      std::vector<char> bytes = store.get(id_key);
      if (bytes.size() != sizeof(id.internal)) {
        throw Error(CAI_INTERNAL, "nccl: malformed unique id under " + id_key);
      }
      std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
    }
    Check(cudaSetDevice(device), "cudaSetDevice");
    Check(ncclCommInitRank(&state_->comm, size, id, rank), "ncclCommInitRank");
  } catch (...) {
    delete state_;
    throw;
  }
}

NcclCommunicator::~NcclCommunicator() {
  if (state_->comm != nullptr) ncclCommDestroy(state_->comm);
  delete state_;
}

void NcclCommunicator::AllReduce(const void* in, void* out, size_t count, cai_dtype dtype,
                                 cai_reduce_op op, void* stream) {
  Check(ncclAllReduce(in, out, count, ToNccl(dtype), ToNccl(op), state_->comm, Stream(stream)),
        "ncclAllReduce");
}

void NcclCommunicator::ReduceScatter(const void* in, void* out, size_t out_count, cai_dtype dtype,
                                     cai_reduce_op op, void* stream) {
  Check(ncclReduceScatter(in, out, out_count, ToNccl(dtype), ToNccl(op), state_->comm,
                          Stream(stream)),
        "ncclReduceScatter");
}

void NcclCommunicator::AllGather(const void* in, void* out, size_t in_count, cai_dtype dtype,
                                 void* stream) {
  Check(ncclAllGather(in, out, in_count, ToNccl(dtype), state_->comm, Stream(stream)),
        "ncclAllGather");
}

void NcclCommunicator::Broadcast(void* buffer, size_t count, cai_dtype dtype, int root,
                                 void* stream) {
  Check(ncclBroadcast(buffer, buffer, count, ToNccl(dtype), root, state_->comm, Stream(stream)),
        "ncclBroadcast");
}

void NcclCommunicator::Reduce(void* buffer, size_t count, cai_dtype dtype, cai_reduce_op op,
                              int root, void* stream) {
  Check(ncclReduce(buffer, buffer, count, ToNccl(dtype), ToNccl(op), root, state_->comm,
                   Stream(stream)),
        "ncclReduce");
}

void NcclCommunicator::AllToAll(const void* in, void* out, size_t count_per_rank, cai_dtype dtype,
                                void* stream) {
  const size_t chunk = count_per_rank * ElementSize(dtype);
  const auto* src = static_cast<const char*>(in);
  auto* dst = static_cast<char*>(out);
  Check(ncclGroupStart(), "ncclGroupStart");
  for (int peer = 0; peer < state_->size; ++peer) {
    Check(ncclSend(src + peer * chunk, count_per_rank, ToNccl(dtype), peer, state_->comm,
                   Stream(stream)),
          "ncclSend");
    Check(ncclRecv(dst + peer * chunk, count_per_rank, ToNccl(dtype), peer, state_->comm,
                   Stream(stream)),
          "ncclRecv");
  }
  Check(ncclGroupEnd(), "ncclGroupEnd");
}

void NcclCommunicator::Send(const void* in, size_t count, cai_dtype dtype, int peer, void* stream) {
  Check(ncclSend(in, count, ToNccl(dtype), peer, state_->comm, Stream(stream)), "ncclSend");
}

void NcclCommunicator::Recv(void* out, size_t count, cai_dtype dtype, int peer, void* stream) {
  Check(ncclRecv(out, count, ToNccl(dtype), peer, state_->comm, Stream(stream)), "ncclRecv");
}

int NcclVersion() {
  int version = 0;
  Check(ncclGetVersion(&version), "ncclGetVersion");
  return version;
}

}  // namespace cai::comm
