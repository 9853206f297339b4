// The collectives of cai_comm_op on a Gloo context: what runs on a group's worker thread.
#pragma once

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "cai/comm.h"

namespace cai::comm {

enum class DType { kF32, kF64, kBF16, kF16, kI32, kI64, kU8 };

size_t DTypeSize(DType dtype);
const char* DTypeName(DType dtype);
cai_dtype ToCaiDType(DType dtype);

// A contiguous CPU buffer copied out of a cai_tensor at issue time (descriptors are borrowed
// for the duration of the call only).
struct Buffer {
  std::byte* data = nullptr;
  size_t numel = 0;
  DType dtype = DType::kF32;
  int cuda_device = -1;  // the CUDA device holding `data`; -1 for host memory
  size_t bytes() const { return numel * DTypeSize(dtype); }
};

struct OpSpec {
  cai_comm_op op = CAI_COMM_BARRIER;
  cai_reduce_op reduce = CAI_REDUCE_SUM;
  Buffer input;
  Buffer output;
  int root = 0;
  int peer = 0;
  uint32_t tag = 0;
  std::chrono::milliseconds timeout{0};
};

// out[i] = a[i] op b[i] for n elements (out may be a or b); bf16/fp16 computed in fp32 and
// rounded once. AVG sums: Average divides afterwards.
using ReduceFn = std::function<void(void*, const void*, const void*, size_t)>;
ReduceFn ReduceFor(DType dtype, cai_reduce_op op);
// Divides every element by group_size (CAI_REDUCE_AVG after the sum).
void Average(const Buffer& buffer, int group_size);

// Runs one collective (every op but SEND/RECV) to completion. `lanes` are contexts over the
// same ranks, each on a transport device (I/O thread) of its own; lanes[0] runs everything
// small and every op but all_reduce, reduce_scatter and all_gather, which are split over the
// lanes from 1 MiB per lane, each lane moving a contiguous share of the elements on a thread of
// its own (as NCCL splits over channels). Throws gloo::Exception (or a subclass) on transport
// failures and timeouts.
void RunCollective(std::span<gloo::Context* const> lanes, const OpSpec& spec);

// Posts a SEND or RECV without waiting; the returned buffer is waited with WaitPointToPoint.
// Gloo's TCP transport moves the data once both sides have posted, so posting never blocks.
std::unique_ptr<gloo::transport::UnboundBuffer> PostPointToPoint(gloo::Context& context,
                                                                 const OpSpec& spec);
void WaitPointToPoint(gloo::transport::UnboundBuffer& buffer, const OpSpec& spec);

// Every rank's `n` values, rank by rank, into `out` (n x context.size): the communicator's own
// small exchanges (the check that ranks call the same collective). Throws like RunCollective.
void AllGatherInt64(gloo::Context& context, const int64_t* in, int64_t* out, size_t n,
                    std::chrono::milliseconds timeout);

// Shuts down (shutdown(2), both ways) the context's TCP connections, so that every operation
// waiting on them fails at once with Gloo's "connection closed" instead of at its timeout; the
// peers see the connections close too. For aborting a communicator whose peer is lost.
void ShutdownConnections(gloo::Context& context);

// Throws gloo::IoException "... closed by peer <address>" (Gloo's words for a lost peer) when
// the connection to `peer` is closed or hung up on; returns at once otherwise. For waits that do
// not go through the connection (comm/shm_ring.h), so that a dead neighbour still fails them.
void ThrowIfPeerClosed(gloo::Context& context, int peer);

// Adds to by_rank[r] (resized to the group) the names Gloo's errors may give the connection to
// rank r ("[127.0.0.1]:41234": its listening address, or the socket's peer address), so that
// "connection closed by peer [127.0.0.1]:41234" can say which rank that was.
void AddPeerEndpoints(gloo::Context& context, std::vector<std::vector<std::string>>& by_rank);

}  // namespace cai::comm
