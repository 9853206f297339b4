#include "comm/store.h"

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "core/status.h"

namespace cai::comm {

namespace {

std::vector<uint8_t> ToBytes(const std::vector<char>& data) {
  return std::vector<uint8_t>(data.begin(), data.end());
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
