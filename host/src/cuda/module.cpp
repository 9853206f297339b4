// libcai_cuda.so: the Module of cuda_module.h over the CUDA runtime and NCCL.
//
// NCCL mapping: all_reduce=ncclAllReduce, reduce_scatter=ncclReduceScatter,
// all_gather=ncclAllGather, broadcast=ncclBroadcast, reduce=ncclReduce, all_to_all=grouped
// ncclSend/ncclRecv pairs, send/recv=ncclSend/ncclRecv, barrier=a one-element all-reduce;
// avg=ncclAvg. Every call is enqueued on the given stream.
#include <cuda_runtime.h>
#include <nccl.h>

#include <cstring>
#include <string>

#include "core/status.h"
#include "cuda/cuda_module.h"
#include "cuda/fused_optim.h"

namespace cai::cuda {
namespace {

void Check(ncclResult_t result, const std::string& what) {
  if (result != ncclSuccess) {
    throw Error(result == ncclInvalidArgument || result == ncclInvalidUsage ? CAI_INVALID_ARGUMENT
                                                                            : CAI_INTERNAL,
                what + " failed: " + ncclGetErrorString(result));
  }
}

void Check(cudaError_t result, const std::string& what) {
  if (result != cudaSuccess) {
    throw Error(CAI_INTERNAL, what + " failed: " + cudaGetErrorString(result));
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

int CountDevices() {
  int count = 0;
  // No driver or no device is an answer here, not an error.
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}

void RequireDevice(int device, const std::string& what) {
  const int count = CountDevices();
  if (device < 0 || device >= count) {
    throw Error(CAI_FAILED_PRECONDITION,
                what + " is on CUDA device " + std::to_string(device) + " but this process sees " +
                    std::to_string(count) +
                    " CUDA device(s) (check the driver, CUDA_VISIBLE_DEVICES and LOCAL_RANK)");
  }
  Check(cudaSetDevice(device), "cudaSetDevice(" + std::to_string(device) + ")");
}

class NcclCollectives final : public Collectives {
 public:
  NcclCollectives(KeyValue& kv, const std::string& key, int rank, int size, int device,
                  std::chrono::milliseconds timeout)
      : size_(size) {
    RequireDevice(device, "NCCL communicator for group '" + key + "'");
    ncclUniqueId id;
    const std::string id_key = "cai/nccl/" + key;
    if (rank == 0) {
      Check(ncclGetUniqueId(&id), "ncclGetUniqueId");
      kv.Set(id_key, std::vector<char>(id.internal, id.internal + sizeof(id.internal)));
    } else {
      const std::vector<char> bytes = kv.Get(id_key, timeout);
      if (bytes.size() != sizeof(id.internal)) {
        throw Error(CAI_INTERNAL, "nccl: malformed unique id under " + id_key);
      }
      std::memcpy(id.internal, bytes.data(), sizeof(id.internal));
    }
    Check(ncclCommInitRank(&comm_, size, id, rank), "ncclCommInitRank");
  }

  ~NcclCollectives() override {
    if (comm_ != nullptr) ncclCommDestroy(comm_);
  }

  void Run(const DeviceOp& op, void* stream_ptr) override {
    auto stream = static_cast<cudaStream_t>(stream_ptr);
    const ncclDataType_t type = op.op == CAI_COMM_BARRIER ? ncclFloat32 : ToNccl(op.dtype);
    switch (op.op) {
      case CAI_COMM_ALL_REDUCE:
        return Check(
            ncclAllReduce(op.output, op.output, op.count, type, ToNccl(op.reduce), comm_, stream),
            "ncclAllReduce");
      case CAI_COMM_REDUCE_SCATTER:
        return Check(ncclReduceScatter(op.input, op.output, op.count, type, ToNccl(op.reduce),
                                       comm_, stream),
                     "ncclReduceScatter");
      case CAI_COMM_ALL_GATHER:
        return Check(ncclAllGather(op.input, op.output, op.count, type, comm_, stream),
                     "ncclAllGather");
      case CAI_COMM_BROADCAST:
        return Check(ncclBroadcast(op.output, op.output, op.count, type, op.root, comm_, stream),
                     "ncclBroadcast");
      case CAI_COMM_REDUCE:
        return Check(ncclReduce(op.output, op.output, op.count, type, ToNccl(op.reduce), op.root,
                                comm_, stream),
                     "ncclReduce");
      case CAI_COMM_ALL_TO_ALL: {
        const size_t chunk = op.count * (op.dtype.bits / 8);
        const auto* src = static_cast<const char*>(op.input);
        auto* dst = static_cast<char*>(op.output);
        Check(ncclGroupStart(), "ncclGroupStart");
        for (int peer = 0; peer < size_; ++peer) {
          Check(ncclSend(src + peer * chunk, op.count, type, peer, comm_, stream), "ncclSend");
          Check(ncclRecv(dst + peer * chunk, op.count, type, peer, comm_, stream), "ncclRecv");
        }
        return Check(ncclGroupEnd(), "ncclGroupEnd");
      }
      case CAI_COMM_SEND:
        return Check(ncclSend(op.input, op.count, type, op.peer, comm_, stream), "ncclSend");
      case CAI_COMM_RECV:
        return Check(ncclRecv(op.output, op.count, type, op.peer, comm_, stream), "ncclRecv");
      case CAI_COMM_BARRIER: {
        if (barrier_ == nullptr) Check(cudaMalloc(&barrier_, sizeof(float)), "cudaMalloc");
        return Check(ncclAllReduce(barrier_, barrier_, 1, ncclFloat32, ncclSum, comm_, stream),
                     "ncclAllReduce (barrier)");
      }
    }
    throw Error(CAI_INVALID_ARGUMENT, "nccl: unknown operation " + std::to_string(op.op));
  }

 private:
  ncclComm_t comm_ = nullptr;
  int size_ = 0;
  void* barrier_ = nullptr;  // leaked with the communicator's device context on purpose
};

class CudaModule final : public Module {
 public:
  int DeviceCount() override { return CountDevices(); }

  std::string Describe() override {
    int runtime = 0, driver = 0, nccl = 0;
    cudaRuntimeGetVersion(&runtime);
    cudaDriverGetVersion(&driver);
    ncclGetVersion(&nccl);
    return "CUDA runtime " + std::to_string(runtime) + ", driver " + std::to_string(driver) +
           ", NCCL " + std::to_string(nccl) + ", " + std::to_string(CountDevices()) + " device(s)";
  }

  std::unique_ptr<Collectives> NewCollectives(KeyValue& kv, const std::string& key, int rank,
                                              int size, int device,
                                              std::chrono::milliseconds timeout) override {
    return std::make_unique<NcclCollectives>(kv, key, rank, size, device, timeout);
  }

  void Adam(const FusedUpdate& u, const GroupHyper& h, bool decoupled, int device,
            void* stream) override {
    RequireDevice(device, "the optimizer update");
    LaunchAdam(u, MakeAdamScalars(u, h, decoupled), stream);
  }

  void Sgd(const FusedUpdate& u, const GroupHyper& h, int device, void* stream) override {
    RequireDevice(device, "the optimizer update");
    LaunchSgd(u, MakeSgdScalars(u, h), h.momentum != 0, stream);
  }
};

}  // namespace
}  // namespace cai::cuda

extern "C" __attribute__((visibility("default"))) cai::cuda::Module* cai_cuda_module_create(
    const char* host_build_id) {
  if (host_build_id == nullptr || std::strcmp(host_build_id, cai::cuda::BuildId()) != 0) {
    return nullptr;
  }
  static cai::cuda::CudaModule module;
  return &module;
}
