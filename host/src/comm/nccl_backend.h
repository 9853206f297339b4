// The NCCL backend for CUDA tensors: one NCCL communicator per cai group, its ncclUniqueId
// created by group rank 0 and passed to the others through the rendezvous store. Built only
// with CAI_WITH_CUDA when CUDA and NCCL are found.
//
// Native mapping: all_reduce=ncclAllReduce, reduce_scatter=ncclReduceScatter,
// all_gather=ncclAllGather, broadcast=ncclBroadcast, reduce=ncclReduce, all_to_all=grouped
// ncclSend/ncclRecv pairs, send/recv=ncclSend/ncclRecv; avg=ncclAvg. Every call is enqueued on
// the given stream and returns without waiting for the device.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

#include "cai/comm.h"

namespace cai::comm {

class Store;

class NcclCommunicator {
 public:
  // Collective over the group's ranks; `key` names the group in the store (same on every rank).
  NcclCommunicator(Store& store, const std::string& key, int rank, int size, int device,
                   std::chrono::milliseconds timeout);
  ~NcclCommunicator();
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  // `stream` is a cudaStream_t; counts are in elements of `dtype`.
  void AllReduce(const void* in, void* out, size_t count, cai_dtype dtype, cai_reduce_op op,
                 void* stream);
  void ReduceScatter(const void* in, void* out, size_t out_count, cai_dtype dtype, cai_reduce_op op,
                     void* stream);
  void AllGather(const void* in, void* out, size_t in_count, cai_dtype dtype, void* stream);
  void Broadcast(void* buffer, size_t count, cai_dtype dtype, int root, void* stream);
  void Reduce(void* buffer, size_t count, cai_dtype dtype, cai_reduce_op op, int root,
              void* stream);
  void AllToAll(const void* in, void* out, size_t count_per_rank, cai_dtype dtype, void* stream);
  void Send(const void* in, size_t count, cai_dtype dtype, int peer, void* stream);
  void Recv(void* out, size_t count, cai_dtype dtype, int peer, void* stream);

 private:
  struct State;
  State* state_;
};

// The NCCL library's version code (e.g. 22803 for 2.28.3); needs no device.
int NcclVersion();

}  // namespace cai::comm
