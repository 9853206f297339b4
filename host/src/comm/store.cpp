#include "comm/store.h"

#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <thread>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "core/status.h"

namespace cai::comm {

namespace {

std::vector<uint8_t> ToBytes(const std::vector<char>& data) {
  return std::vector<uint8_t>(data.begin(), data.end());
}

// Whether a connection to host:port completes within `wait` (a listener is there).
bool Connects(const addrinfo& a, std::chrono::milliseconds wait) {
  const int fd = ::socket(a.ai_family, a.ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a.ai_protocol);
  if (fd < 0) return false;
  bool ok = ::connect(fd, a.ai_addr, a.ai_addrlen) == 0;
  if (!ok && errno == EINPROGRESS) {
    pollfd p{fd, POLLOUT, 0};
    int error = 0;
    socklen_t size = sizeof(error);
    ok = ::poll(&p, 1, static_cast<int>(wait.count())) == 1 &&
         ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &size) == 0 && error == 0;
  }
  ::close(fd);
  return ok;
}

// c10d's client sleeps a whole second after each refused connection (LibTorch 1.13), and the
// other ranks, started with rank 0, usually ask before rank 0 listens: most local jobs lost
// that second at start. Waiting for the listener here, in short steps, keeps it. Returns false
// when nothing listened before the deadline; an address that does not resolve is left to
// TCPStore, which names it.
bool WaitForListener(const std::string& host, int port, std::chrono::milliseconds timeout) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return true;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  constexpr std::chrono::milliseconds kStep(10);
  bool listening = false;
  while (!listening && std::chrono::steady_clock::now() < deadline) {
    for (const addrinfo* a = found; a && !listening; a = a->ai_next) {
      listening = Connects(*a, std::chrono::milliseconds(200));
    }
    if (!listening) std::this_thread::sleep_for(kStep);
  }
  ::freeaddrinfo(found);
  return listening;
}

}  // namespace

Store::Store(const std::string& host, int port, bool is_server, std::chrono::milliseconds timeout)
    : timeout_(timeout) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(port);
  options.isServer = is_server;
  // Who is missing is reported by the communicator's own join keys, with names, instead of
  // TCPStore's anonymous worker count.
  options.waitWorkers = false;
  options.timeout = timeout;
  if (!is_server && !WaitForListener(host, port, timeout)) {
    throw Error(CAI_UNAVAILABLE, "cannot reach the rendezvous store at " + host + ":" +
                                     std::to_string(port) + ": nothing listened there within " +
                                     std::to_string(timeout.count()) +
                                     " ms (is rank 0 running, is MASTER_ADDR right?)");
  }
  try {
    store_ = std::make_unique<c10d::TCPStore>(host, options);
  } catch (const std::exception& e) {
    throw Error(CAI_UNAVAILABLE, std::string("cannot ") + (is_server ? "serve" : "reach") +
                                     " the rendezvous store at " + host + ":" +
                                     std::to_string(port) + ": " + e.what() +
                                     (is_server ? " (is the port already in use?)"
                                                : " (is rank 0 running, is MASTER_ADDR right?)"));
  }
}

Store::~Store() = default;

void Store::set(const std::string& key, const std::vector<char>& data) {
  std::lock_guard<std::mutex> lock(mu_);
  store_->set(key, ToBytes(data));
}

std::vector<char> Store::get(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto bytes = store_->get(key);
  return std::vector<char>(bytes.begin(), bytes.end());
}

void Store::wait(const std::vector<std::string>& keys) { wait(keys, timeout_); }

void Store::wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    try {
      store_->wait(keys, timeout);
      return;
    } catch (const std::exception&) {
      // Fall through to name the missing keys; TCPStore's own message does not.
    }
  }
  std::string missing;
  for (const auto& key : Missing(keys)) missing += (missing.empty() ? "" : ", ") + key;
  throw Error(CAI_DEADLINE_EXCEEDED, "rendezvous store: keys still missing after " +
                                         std::to_string(timeout.count()) + " ms: " + missing);
}

std::optional<std::string> Store::TryGet(const std::string& key) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!store_->check({key})) return std::nullopt;
  auto bytes = store_->get(key);
  return std::string(bytes.begin(), bytes.end());
}

void Store::SetString(const std::string& key, const std::string& value) {
  std::lock_guard<std::mutex> lock(mu_);
  store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::vector<std::string> Store::Missing(const std::vector<std::string>& keys) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> missing;
  for (const auto& key : keys) {
    if (!store_->check({key})) missing.push_back(key);
  }
  return missing;
}

}  // namespace cai::comm
