// The host's CUDA support: NCCL collectives and the fused optimizer kernels for tensors on a
// CUDA device. It is built as a module of its own, libcai_cuda.so, when CUDA and NCCL are
// found, and loaded the first time a CUDA tensor reaches a service. The host library, its
// package and every CPU-only machine therefore never need the CUDA runtime or NCCL; a host
// built without them answers a CUDA tensor with an error that says so.
//
// Host and module come from the same build (the build id is checked at load), so this
// interface is C++ and may change with any release; it is not part of the plugin ABI.
// No CUDA headers here.
#pragma once

#include <chrono>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "cai/comm.h"
#include "optim/optimizer.h"

namespace cai::cuda {

// Where the rendezvous keeps NCCL's unique ids (the communicator's store).
class KeyValue {
 public:
  virtual ~KeyValue() = default;
  virtual void Set(const std::string& key, const std::vector<char>& value) = 0;
  // Blocks until `key` is set; throws DEADLINE_EXCEEDED after `timeout`.
  virtual std::vector<char> Get(const std::string& key, std::chrono::milliseconds timeout) = 0;
};

// One collective on device memory, validated by the communicator. Counts are elements of
// `dtype`: for REDUCE_SCATTER the output's, for ALL_GATHER the input's, for ALL_TO_ALL the
// elements per rank, otherwise the buffer's.
struct DeviceOp {
  cai_comm_op op = CAI_COMM_ALL_REDUCE;
  cai_reduce_op reduce = CAI_REDUCE_SUM;
  const void* input = nullptr;
  void* output = nullptr;
  size_t count = 0;
  cai_dtype dtype{};
  int root = 0;
  int peer = 0;
};

// One group's NCCL communicator on one device.
class Collectives {
 public:
  virtual ~Collectives() = default;
  // Enqueues `op` on `stream` (a cudaStream_t; nullptr = the legacy default stream) and
  // returns without waiting for the device.
  virtual void Run(const DeviceOp& op, void* stream) = 0;
};

class Module {
 public:
  virtual ~Module() = default;
  // CUDA devices this process can use; 0 when there is no driver or no device.
  virtual int DeviceCount() = 0;
  // "CUDA runtime 13000, driver 0, NCCL 22803": what the module was built with and found.
  virtual std::string Describe() = 0;
  // Collective over the group's ranks (every rank calls it in the same order): group rank 0
  // creates the NCCL id and publishes it under `key`. Throws FAILED_PRECONDITION when
  // `device` does not exist.
  virtual std::unique_ptr<Collectives> NewCollectives(KeyValue& kv, const std::string& key,
                                                      int rank, int size, int device,
                                                      std::chrono::milliseconds timeout) = 0;
  // The fused updates of fused_update.h on device memory, enqueued on `stream`; the same
  // arithmetic as the CPU kernels.
  virtual void Adam(const FusedUpdate& u, const GroupHyper& h, bool decoupled, int device,
                    void* stream) = 0;
  virtual void Sgd(const FusedUpdate& u, const GroupHyper& h, int device, void* stream) = 0;
};

// The module, loaded once (thread-safe): from $CAI_CUDA_MODULE when set (ignored in setuid
// processes), else cai/libcai_cuda.so beside the library this code is linked into; trusted as
// a plugin is (file_checks.h) and loaded from the descriptor that was checked. Throws
// PERMISSION_DENIED for an untrusted file or directory, naming the variable, the path and
// the chmod or chown to run; UNAVAILABLE naming the path and the reason otherwise (not built
// with CUDA, missing file, unresolved CUDA libraries, build-id mismatch) with what to do.
Module& Load();

// The build id host and module must share: same release, same interface revision, same
// compiler.
inline const char* BuildId() { return "cai " CAI_VERSION " cuda-module 1 gcc " __VERSION__; }

}  // namespace cai::cuda

// The module's only export.
extern "C" cai::cuda::Module* cai_cuda_module_create(const char* host_build_id);
