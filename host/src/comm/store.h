// The rendezvous store: a client of c10d's TCPStore (rank 0 also serves it), seen by Gloo
// through gloo::rendezvous::Store. The only comm translation unit that sees LibTorch is
// store.cpp; this header keeps c10d out of everything else.
#pragma once

#include <gloo/rendezvous/store.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace c10d {
class TCPStore;
}

namespace cai::comm {

// Thread-safe: calls are serialised on one connection, so a blocking wait holds up others;
// give independent users their own Store.
class Store : public gloo::rendezvous::Store {
 public:
  // Rank 0 passes is_server = true and starts the server in this process.
  Store(const std::string& host, int port, bool is_server, std::chrono::milliseconds timeout);
  ~Store() override;

  void set(const std::string& key, const std::vector<char>& data) override;
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  // Throws cai::Error DEADLINE_EXCEEDED listing the keys still missing after `timeout`.
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;

  // The value of `key` if it is set now; never blocks.
  std::optional<std::string> TryGet(const std::string& key);
  // Returns once the request is sent (c10d does not wait for a reply): another connection
  // sees the key only after the server has handled it, so readers wait() for it.
  void SetString(const std::string& key, const std::string& value);
  // The keys of `keys` that are not set now.
  std::vector<std::string> Missing(const std::vector<std::string>& keys);

 private:
  std::mutex mu_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<c10d::TCPStore> store_;
};

}  // namespace cai::comm
