// An in-memory communicator group for tests of the model's tensor- and sequence-parallel
// forward and backward: `n` ranks as threads of this process.
#pragma once

#include <torch/torch.h>

#include <barrier>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "model/network.h"

namespace cai::testing {

// Every collective copies each rank's tensor into a slot and combines the slots in rank order,
// so all ranks compute the same bits.
class ThreadGroup {
 public:
  explicit ThreadGroup(int n) : n_(n), barrier_(n), slots_(n) {}

  TensorParallelGroup Rank(int r) {
    TensorParallelGroup g;
    g.rank = r;
    g.size = n_;
    g.all_reduce = [this, r](const torch::Tensor& t, cai_reduce_op op) {
      slots_[r] = t.clone();
      barrier_.arrive_and_wait();
      torch::Tensor acc = slots_[0].clone();
      for (int i = 1; i < n_; ++i) {
        acc = op == CAI_REDUCE_MAX ? torch::maximum(acc, slots_[i]) : acc + slots_[i];
      }
      barrier_.arrive_and_wait();
      t.copy_(acc);
    };
    g.all_gather = [this, r](const torch::Tensor& in, const torch::Tensor& out) {
      slots_[r] = in.reshape(-1).clone();
      barrier_.arrive_and_wait();
      out.view({n_, -1}).copy_(torch::stack(slots_));
      barrier_.arrive_and_wait();
    };
    // Part i of rank j's input lands as part j of rank i's output.
    g.all_to_all = [this, r](const torch::Tensor& in, const torch::Tensor& out) {
      slots_[r] = in.reshape({n_, -1}).clone();
      barrier_.arrive_and_wait();
      for (int j = 0; j < n_; ++j) out.view({n_, -1})[j].copy_(slots_[j][r]);
      barrier_.arrive_and_wait();
    };
    // A mailbox per rank and channel: sending never waits, receiving waits for the message.
    g.shift = [this, r](const torch::Tensor& send, const torch::Tensor& recv, int channel) {
      Mailbox& to = mail_[(r + 1) % n_];
      {
        std::lock_guard<std::mutex> lock(to.mu);
        to.queues[channel].push_back(send.clone());
      }
      to.cv.notify_all();
      Mailbox& mine = mail_[r];
      std::unique_lock<std::mutex> lock(mine.mu);
      mine.cv.wait(lock, [&] { return !mine.queues[channel].empty(); });
      recv.copy_(mine.queues[channel].front());
      mine.queues[channel].pop_front();
    };
    return g;
  }

 private:
  struct Mailbox {
    std::mutex mu;
    std::condition_variable cv;
    std::map<int, std::deque<torch::Tensor>> queues;
  };

  int n_;
  std::barrier<> barrier_;
  std::vector<torch::Tensor> slots_;
  std::vector<Mailbox> mail_ = std::vector<Mailbox>(n_);
};

// Rank `rank` of a group of `size` with no collectives: for what fails before communicating
// (refusals) or only cuts parameters.
inline TensorParallelGroup Alone(int rank, int size) {
  TensorParallelGroup g;
  g.rank = rank;
  g.size = size;
  return g;
}

// Runs fn(rank) for ranks 0..n-1, each on a thread of its own (the ranks of a ThreadGroup),
// and rethrows the first rank's exception, if any, once all have ended.
inline void RunOnThreads(int n, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

}  // namespace cai::testing
