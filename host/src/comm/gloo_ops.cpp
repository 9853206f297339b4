#include "comm/gloo_ops.h"

#include <arpa/inet.h>
#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/reduce.h>
#include <gloo/types.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <span>
#include <thread>
#include <vector>

#include "comm/pair_socket.h"

namespace cai::comm {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DType::kF64:
    case DType::kI64:
      return 8;
    case DType::kF32:
    case DType::kI32:
      return 4;
    case DType::kBF16:
    case DType::kF16:
      return 2;
    case DType::kU8:
      return 1;
  }
  return 1;
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return "float32";
    case DType::kF64:
      return "float64";
    case DType::kBF16:
      return "bfloat16";
    case DType::kF16:
      return "float16";
    case DType::kI32:
      return "int32";
    case DType::kI64:
      return "int64";
    case DType::kU8:
      return "uint8";
  }
  return "?";
}

cai_dtype ToCaiDType(DType dtype) {
  switch (dtype) {
    case DType::kF32:
      return {CAI_DTYPE_FLOAT, 32, 1};
    case DType::kF64:
      return {CAI_DTYPE_FLOAT, 64, 1};
    case DType::kBF16:
      return {CAI_DTYPE_BFLOAT, 16, 1};
    case DType::kF16:
      return {CAI_DTYPE_FLOAT, 16, 1};
    case DType::kI32:
      return {CAI_DTYPE_INT, 32, 1};
    case DType::kI64:
      return {CAI_DTYPE_INT, 64, 1};
    case DType::kU8:
      return {CAI_DTYPE_UINT, 8, 1};
  }
  return {};
}

namespace {

// Slot prefixes of our own algorithms, above Gloo's (0x01-0x08 in gloo/types.h) so that a
// point-to-point message can never be matched by a collective or the other way round.
constexpr uint8_t kReduceScatterSlotPrefix = 0x40;
constexpr uint8_t kPointToPointSlotPrefix = 0x41;
constexpr uint8_t kAllGatherSlotPrefix = 0x42;

// Our rings move their data in messages of at most this size, so that the reduction (or the
// forwarding) of one overlaps the transfer of the next.
constexpr size_t kSegmentBytes = size_t{1} << 20;

// A collective on at least this many bytes per lane is split over the lanes: below it the
// extra thread and messages cost more than the second connection gains.
constexpr size_t kMinLaneBytes = size_t{1} << 20;

// Half-precision types are reduced in fp32 and rounded once per pairwise step, as NCCL does
// on the wire for bf16/fp16 (comm.h: "reduced in fp32 precision where the backend cannot").
struct Bf16 {
  uint16_t bits;
};
struct F16 {
  uint16_t bits;
};

float ToFloat(Bf16 v) { return std::bit_cast<float>(static_cast<uint32_t>(v.bits) << 16); }

Bf16 FromFloat(float f, Bf16) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if (std::isnan(f)) return Bf16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fff + ((u >> 16) & 1);  // round to nearest, ties to even
  return Bf16{static_cast<uint16_t>(u >> 16)};
}

// IEEE 754 binary16 <-> binary32, round to nearest even; Gloo's own conversions are not
// exported from libgloo.
float ToFloat(F16 v) {
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000) << 16;
  const uint32_t exponent = (v.bits >> 10) & 0x1f;
  const uint32_t mantissa = v.bits & 0x3ff;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000 | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  return std::bit_cast<float>(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

F16 FromFloat(float f, F16) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
  const float magnitude = std::fabs(f);
  if (std::isnan(f)) return F16{static_cast<uint16_t>(sign | 0x7e00)};
  if (magnitude >= 65520.0f) return F16{static_cast<uint16_t>(sign | 0x7c00)};  // overflow
  if (magnitude < 6.103515625e-05f) {  // subnormal range: units of 2^-24, rint ties to even
    return F16{static_cast<uint16_t>(
        sign | static_cast<uint16_t>(std::nearbyint(std::ldexp(magnitude, 24))))};
  }
  uint32_t m = u & 0x7fffffff;
  m += 0xfff + ((m >> 13) & 1);  // round the 13 dropped bits to nearest even
  return F16{static_cast<uint16_t>(sign | ((m - (112u << 23)) >> 13))};
}

template <class T>
struct Compute {
  using type = T;
  static T Load(T v) { return v; }
  static T Store(T v) { return v; }
};
template <>
struct Compute<Bf16> {
  using type = float;
  static float Load(Bf16 v) { return ToFloat(v); }
  static Bf16 Store(float v) { return FromFloat(v, Bf16{}); }
};
template <>
struct Compute<F16> {
  using type = float;
  static float Load(F16 v) { return ToFloat(v); }
  static F16 Store(float v) { return FromFloat(v, F16{}); }
};

template <class T, class Op>
void Elementwise(void* out, const void* a, const void* b, size_t n, Op op) {
  using C = Compute<T>;
  auto* o = static_cast<T*>(out);
  const auto* x = static_cast<const T*>(a);
  const auto* y = static_cast<const T*>(b);
  for (size_t i = 0; i < n; ++i) o[i] = C::Store(op(C::Load(x[i]), C::Load(y[i])));
}

template <class T>
ReduceFn MakeReduce(cai_reduce_op op) {
  using V = typename Compute<T>::type;
  switch (op) {
    case CAI_REDUCE_MAX:
      return [](void* o, const void* a, const void* b, size_t n) {
        Elementwise<T>(o, a, b, n, [](V x, V y) { return std::max(x, y); });
      };
    case CAI_REDUCE_MIN:
      return [](void* o, const void* a, const void* b, size_t n) {
        Elementwise<T>(o, a, b, n, [](V x, V y) { return std::min(x, y); });
      };
    case CAI_REDUCE_PRODUCT:
      return [](void* o, const void* a, const void* b, size_t n) {
        Elementwise<T>(o, a, b, n, [](V x, V y) { return static_cast<V>(x * y); });
      };
    default:  // SUM, and AVG which divides the sum afterwards (DivideInPlace)
      return [](void* o, const void* a, const void* b, size_t n) {
        Elementwise<T>(o, a, b, n, [](V x, V y) { return static_cast<V>(x + y); });
      };
  }
}

template <class T>
void DivideInPlace(void* data, size_t n, int divisor) {
  using C = Compute<T>;
  using V = typename C::type;
  auto* p = static_cast<T*>(data);
  for (size_t i = 0; i < n; ++i) p[i] = C::Store(static_cast<V>(C::Load(p[i]) / divisor));
}

template <class Fn>
decltype(auto) Dispatch(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32:
      return fn(float{});
    case DType::kF64:
      return fn(double{});
    case DType::kBF16:
      return fn(Bf16{});
    case DType::kF16:
      return fn(F16{});
    case DType::kI32:
      return fn(int32_t{});
    case DType::kI64:
      return fn(int64_t{});
    case DType::kU8:
      return fn(uint8_t{});
  }
  return fn(uint8_t{});
}

}  // namespace

ReduceFn ReduceFor(DType dtype, cai_reduce_op op) {
  return Dispatch(dtype, [&](auto t) { return MakeReduce<decltype(t)>(op); });
}

void Average(const Buffer& buffer, int group_size) {
  Dispatch(buffer.dtype,
           [&](auto t) { DivideInPlace<decltype(t)>(buffer.data, buffer.numel, group_size); });
}

namespace {

// Gloo's option classes take the element type as a template argument only for its size; an
// opaque element of the right size lets one code path serve every dtype.
template <size_t N>
struct Element {
  std::byte b[N];
};

template <class Fn>
void WithElementSize(size_t size, Fn&& fn) {
  switch (size) {
    case 1:
      fn(Element<1>{});
      break;
    case 2:
      fn(Element<2>{});
      break;
    case 4:
      fn(Element<4>{});
      break;
    default:
      fn(Element<8>{});
      break;
  }
}

// One lane's share of a collective split over lanes (RunCollective): the elements
// [lo, lo + len) of each rank's chunk (reduce_scatter, all_gather) or of the whole tensor
// (all_reduce).
struct Part {
  size_t lo = 0;
  size_t len = 0;
};

Buffer Slice(const Buffer& b, const Part& part) {
  return Buffer{b.data + part.lo * DTypeSize(b.dtype), part.len, b.dtype, b.cuda_device};
}

// What a ring of our own needs to know: the neighbours, the part's place and size in bytes,
// the segment its messages are cut into, and when the operation must be done.
struct Ring {
  Ring(const gloo::Context& context, const OpSpec& spec, const Part& part)
      : n(context.size),
        r(context.rank),
        left((r + n - 1) % n),
        right((r + 1) % n),
        element(DTypeSize(spec.output.dtype)),
        part_offset(part.lo * element),
        part_bytes(part.len * element),
        segment(std::max(element, kSegmentBytes / element * element)),
        deadline(std::chrono::steady_clock::now() + spec.timeout) {}
  int n, r, left, right;
  size_t element, part_offset, part_bytes, segment;
  std::chrono::steady_clock::time_point deadline;
};

std::chrono::milliseconds Remaining(std::chrono::steady_clock::time_point deadline) {
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::duration_cast<std::chrono::milliseconds>(
                      deadline - std::chrono::steady_clock::now()));
}

void AllReduce(gloo::Context& context, const OpSpec& spec, const Part& part) {
  std::shared_ptr<gloo::Context> shared(std::shared_ptr<gloo::Context>(), &context);
  const Buffer out = Slice(spec.output, part);
  gloo::AllreduceOptions opts(shared);
  WithElementSize(DTypeSize(out.dtype), [&](auto e) {
    using E = decltype(e);
    opts.setOutput<E>(reinterpret_cast<E*>(out.data), out.numel);
  });
  opts.setReduceFunction(ReduceFor(out.dtype, spec.reduce));
  opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
  opts.setTimeout(spec.timeout);
  gloo::allreduce(opts);
  if (spec.reduce == CAI_REDUCE_AVG) Average(out, context.size);
}

void Reduce(gloo::Context& context, const std::shared_ptr<gloo::Context>& shared,
            const OpSpec& spec) {
  const Buffer& out = spec.output;
  gloo::ReduceOptions opts(shared);
  WithElementSize(DTypeSize(out.dtype), [&](auto e) {
    using E = decltype(e);
    opts.setOutput<E>(reinterpret_cast<E*>(out.data), out.numel);
  });
  opts.setRoot(spec.root);
  opts.setReduceFunction(ReduceFor(out.dtype, spec.reduce));
  opts.setTimeout(spec.timeout);
  gloo::reduce(opts);
  if (spec.reduce == CAI_REDUCE_AVG && context.rank == spec.root) Average(out, context.size);
}

// Ring reduce-scatter: n-1 steps, each sending one chunk to the right neighbour and reducing
// the chunk arriving from the left into a scratch chunk, so every rank sends exactly
// (n-1)/n of its input (the lower bound; Patarasuk & Yuan, JPDC 2009) and the input is left
// untouched. Gloo's ReduceScatterHalvingDoubling would reduce in place over the input and binds
// its buffers to fixed pointers at construction, which needs a cached instance and a copy of
// the input per call. The chunk arriving at step s is received in segments so that reducing
// one overlaps the transfer of the next. Only `part` of every chunk moves on this context.
void ReduceScatter(gloo::Context& context, const OpSpec& spec, const Part& part) {
  const auto [n, r, left, right, element, part_offset, part_bytes, segment, deadline] =
      Ring(context, spec, part);
  const size_t chunk_bytes = spec.output.bytes();
  const auto* in = spec.input.data;
  const ReduceFn reduce = ReduceFor(spec.output.dtype, spec.reduce);
  const uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, spec.tag);

  std::vector<std::byte> scratch(n > 2 ? 2 * part_bytes : 0);
  auto input_buffer = context.createUnboundBuffer(const_cast<std::byte*>(in), spec.input.bytes());
  auto output_buffer = context.createUnboundBuffer(spec.output.data, chunk_bytes);
  std::unique_ptr<gloo::transport::UnboundBuffer> scratch_buffers[2];
  if (n > 2) {
    scratch_buffers[0] = context.createUnboundBuffer(scratch.data(), part_bytes);
    scratch_buffers[1] = context.createUnboundBuffer(scratch.data() + part_bytes, part_bytes);
  }

  // Step s sends the partial sum of chunk (r-s-1) and receives that of chunk (r-s-2); the
  // last step receives chunk r, which completes in `output`.
  gloo::transport::UnboundBuffer* send_buffer = input_buffer.get();
  size_t send_offset = static_cast<size_t>((r + n - 1) % n) * chunk_bytes + part_offset;
  for (int s = 0; s + 1 < n; ++s) {
    const bool last = s + 2 == n;
    gloo::transport::UnboundBuffer* recv_buffer =
        last ? output_buffer.get() : scratch_buffers[s % 2].get();
    const size_t recv_offset = last ? part_offset : 0;
    const size_t local_offset =
        static_cast<size_t>((r - s - 2 + 2 * n) % n) * chunk_bytes + part_offset;
    size_t segments = 0;
    for (size_t off = 0; off < part_bytes; off += segment, ++segments) {
      recv_buffer->recv(left, slot, recv_offset + off, std::min(segment, part_bytes - off));
    }
    // Gloo matches one send with one receive, so both sides cut the chunk the same way.
    for (size_t off = 0; off < part_bytes; off += segment) {
      send_buffer->send(right, slot, send_offset + off, std::min(segment, part_bytes - off));
    }
    for (size_t i = 0; i < segments; ++i) {
      recv_buffer->waitRecv(Remaining(deadline));
      const size_t off = i * segment;
      auto* acc = static_cast<std::byte*>(recv_buffer->ptr) + recv_offset + off;
      reduce(acc, acc, in + local_offset + off, std::min(segment, part_bytes - off) / element);
    }
    for (size_t i = 0; i < segments; ++i) send_buffer->waitSend(Remaining(deadline));
    send_buffer = recv_buffer;
    send_offset = recv_offset;
  }
  if (spec.reduce == CAI_REDUCE_AVG) Average(Slice(spec.output, part), n);
}

// Ring all-gather straight into the output: n-1 steps, each forwarding to the right the block
// that arrived from the left one step before, so every rank sends (n-1)/n of the output. A
// segment is forwarded as soon as it has arrived, so the steps overlap rather than wait for
// each other. In place (as NCCL's) when the input is this rank's block of the output. Only
// `part` of every block moves on this context.
void AllGather(gloo::Context& context, const OpSpec& spec, const Part& part) {
  const auto [n, r, left, right, element, part_offset, part_bytes, segment, deadline] =
      Ring(context, spec, part);
  const size_t block_bytes = spec.input.bytes();
  std::byte* out = spec.output.data;
  const uint64_t slot = gloo::Slot::build(kAllGatherSlotPrefix, spec.tag);
  auto block = [&](int b) { return static_cast<size_t>(b) * block_bytes + part_offset; };

  std::byte* mine = out + block(r);
  if (spec.input.data + part_offset != mine) {
    std::memcpy(mine, spec.input.data + part_offset, part_bytes);
  }
  auto buffer = context.createUnboundBuffer(out, spec.output.bytes());
  std::vector<size_t> lengths;
  for (size_t off = 0; off < part_bytes; off += segment) {
    lengths.push_back(std::min(segment, part_bytes - off));
  }
  // Receives complete in the order they are posted (one connection from the left), so the
  // k-th completion is step k / segments, segment k % segments.
  for (int s = 0; s + 1 < n; ++s) {
    for (size_t i = 0; i < lengths.size(); ++i) {
      buffer->recv(left, slot, block((r - s - 1 + n) % n) + i * segment, lengths[i]);
    }
  }
  for (size_t i = 0; i < lengths.size(); ++i) {
    buffer->send(right, slot, block(r) + i * segment, lengths[i]);
  }
  size_t sends = lengths.size();
  for (int s = 0; s + 1 < n; ++s) {
    for (size_t i = 0; i < lengths.size(); ++i) {
      buffer->waitRecv(Remaining(deadline));
      if (s + 2 < n) {  // the right neighbour still needs this block
        buffer->send(right, slot, block((r - s - 1 + n) % n) + i * segment, lengths[i]);
        ++sends;
      }
    }
  }
  for (size_t i = 0; i < sends; ++i) buffer->waitSend(Remaining(deadline));
}

// How many lanes `spec` is split over: all_reduce, reduce_scatter and all_gather of at least
// kMinLaneBytes per lane, each lane taking a contiguous share of the elements.
size_t LanesFor(size_t lanes, const OpSpec& spec, size_t units) {
  const size_t bytes = std::max(spec.input.bytes(), spec.output.bytes());
  return std::clamp<size_t>(bytes / kMinLaneBytes, 1, std::min(lanes, units));
}

void RunPart(gloo::Context& context, const OpSpec& spec, const Part& part) {
  switch (spec.op) {
    case CAI_COMM_ALL_REDUCE:
      AllReduce(context, spec, part);
      return;
    case CAI_COMM_REDUCE_SCATTER:
      ReduceScatter(context, spec, part);
      return;
    default:
      AllGather(context, spec, part);
      return;
  }
}

// Lane 0 runs on the calling thread, every other lane on a thread of its own: each lane's
// connections are served by their own Gloo I/O thread, so the lanes' transfers, reductions and
// socket copies proceed at once instead of queueing on one thread.
void SplitOverLanes(std::span<gloo::Context* const> lanes, const OpSpec& spec) {
  const size_t units = spec.op == CAI_COMM_ALL_GATHER ? spec.input.numel : spec.output.numel;
  const size_t parts = LanesFor(lanes.size(), spec, units);
  auto run = [&](size_t j) {
    const size_t lo = units * j / parts;
    RunPart(*lanes[j], spec, Part{lo, units * (j + 1) / parts - lo});
  };
  if (parts == 1) {
    run(0);
    return;
  }
  std::vector<std::exception_ptr> errors(parts);
  std::vector<std::thread> threads;
  for (size_t j = 1; j < parts; ++j) {
    threads.emplace_back([&, j] {
      try {
        run(j);
      } catch (...) {
        errors[j] = std::current_exception();
      }
    });
  }
  try {
    run(0);
  } catch (...) {
    errors[0] = std::current_exception();
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace

void RunCollective(std::span<gloo::Context* const> lanes, const OpSpec& spec) {
  gloo::Context& context = *lanes.front();
  // Gloo's option classes hold a shared_ptr to the context; the group owns it for longer than
  // any operation, so a non-owning alias is enough.
  std::shared_ptr<gloo::Context> shared(std::shared_ptr<gloo::Context>(), &context);
  if (spec.op != CAI_COMM_BARRIER && spec.input.numel == 0 && spec.output.numel == 0) return;
  if (context.size == 1) {  // a group of one: every collective is the identity
    if (spec.input.data != nullptr && spec.output.data != nullptr &&
        spec.input.data != spec.output.data) {
      std::memcpy(spec.output.data, spec.input.data, spec.output.bytes());
    }
    return;
  }
  switch (spec.op) {
    case CAI_COMM_ALL_REDUCE:
    case CAI_COMM_REDUCE_SCATTER:
    case CAI_COMM_ALL_GATHER:
      SplitOverLanes(lanes, spec);
      return;
    case CAI_COMM_BROADCAST: {
      gloo::BroadcastOptions opts(shared);
      opts.setOutput<std::byte>(spec.output.data, spec.output.bytes());
      opts.setRoot(spec.root);
      opts.setTimeout(spec.timeout);
      gloo::broadcast(opts);
      return;
    }
    case CAI_COMM_REDUCE:
      Reduce(context, shared, spec);
      return;
    case CAI_COMM_ALL_TO_ALL: {
      gloo::AlltoallOptions opts(shared);
      opts.setInput<std::byte>(spec.input.data, spec.input.bytes());
      opts.setOutput<std::byte>(spec.output.data, spec.output.bytes());
      opts.setTimeout(spec.timeout);
      gloo::alltoall(opts);
      return;
    }
    case CAI_COMM_BARRIER: {
      gloo::BarrierOptions opts(shared);
      opts.setTimeout(spec.timeout);
      gloo::barrier(opts);
      return;
    }
    default:
      GLOO_ENFORCE(false, "not a collective: op ", spec.op);
  }
}

std::unique_ptr<gloo::transport::UnboundBuffer> PostPointToPoint(gloo::Context& context,
                                                                 const OpSpec& spec) {
  const bool send = spec.op == CAI_COMM_SEND;
  const Buffer& b = send ? spec.input : spec.output;
  auto buffer = context.createUnboundBuffer(b.data, b.bytes());
  const uint64_t slot = gloo::Slot::build(kPointToPointSlotPrefix, spec.tag);
  if (b.bytes() == 0) return buffer;
  if (send) {
    buffer->send(spec.peer, slot);
  } else {
    buffer->recv(spec.peer, slot);
  }
  return buffer;
}

void WaitPointToPoint(gloo::transport::UnboundBuffer& buffer, const OpSpec& spec) {
  if (buffer.size == 0) return;
  if (spec.op == CAI_COMM_SEND) {
    buffer.waitSend(spec.timeout);
  } else {
    buffer.waitRecv(spec.timeout);
  }
}

void AllGatherInt64(gloo::Context& context, const int64_t* in, int64_t* out, size_t n,
                    std::chrono::milliseconds timeout) {
  std::shared_ptr<gloo::Context> shared(std::shared_ptr<gloo::Context>(), &context);
  gloo::AllgatherOptions opts(shared);
  opts.setInput<int64_t>(const_cast<int64_t*>(in), n);
  opts.setOutput<int64_t>(out, n * static_cast<size_t>(context.size));
  opts.setTimeout(timeout);
  gloo::allgather(opts);
}

void ShutdownConnections(gloo::Context& context) {
  for (int peer = 0; peer < context.size; ++peer) {
    if (peer == context.rank) continue;
    auto* pair = dynamic_cast<gloo::transport::tcp::Pair*>(context.getPair(peer).get());
    if (pair != nullptr) WithPairSocket(*pair, [](int fd) { ::shutdown(fd, SHUT_RDWR); });
  }
}

void ThrowIfPeerClosed(gloo::Context& context, int peer) {
  auto* pair = dynamic_cast<gloo::transport::tcp::Pair*>(context.getPair(peer).get());
  if (pair == nullptr) return;
  bool hung_up = false;
  const bool open = WithPairSocket(*pair, [&](int fd) {
    pollfd p{fd, POLLRDHUP, 0};
    hung_up = ::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
  });
  if (!open || hung_up) {
    // Gloo's own wording, which the communicator's ClosedBy matches to name the rank.
    throw gloo::IoException("shared-memory ring: connection closed by peer " +
                            (pair->*PairSocket::kPeer).str());
  }
}

void AddPeerEndpoints(gloo::Context& context, std::vector<std::vector<std::string>>& by_rank) {
  by_rank.resize(static_cast<size_t>(context.size));
  for (int peer = 0; peer < context.size; ++peer) {
    if (peer == context.rank) continue;
    auto* pair = dynamic_cast<gloo::transport::tcp::Pair*>(context.getPair(peer).get());
    if (pair == nullptr) continue;
    std::vector<std::string>& names = by_rank[static_cast<size_t>(peer)];
    names.push_back((pair->*PairSocket::kPeer).str());
    WithPairSocket(*pair, [&](int fd) {
      sockaddr_in address{};
      socklen_t len = sizeof(address);
      char ip[INET_ADDRSTRLEN] = {};
      if (getpeername(fd, reinterpret_cast<sockaddr*>(&address), &len) != 0 ||
          address.sin_family != AF_INET ||
          inet_ntop(AF_INET, &address.sin_addr, ip, sizeof(ip)) == nullptr) {
        return;
      }
      // Gloo prints an accepted connection's peer by its socket address; the port in either
      // byte order, as Gloo versions differ.
      for (const uint16_t port : {ntohs(address.sin_port), address.sin_port}) {
        names.push_back("[" + std::string(ip) + "]:" + std::to_string(port));
      }
    });
  }
}

}  // namespace cai::comm
