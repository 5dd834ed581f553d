// SPDX-License-Identifier: Apache-2.0
// A raw ZooKeeper C-client handle for the tests, to look at (and tamper with) the nodes
// themselves, beside the turnstile client under test.
#pragma once

#include <zookeeper/zookeeper.h>

#include <chrono>
#include <string>
#include <thread>
#include <vector>

namespace zookeeper_tests {

class RawZk {
 public:
  // `hosts`: "host:port"; `digest`: "user:password" to authenticate with, if any.
  explicit RawZk(const std::string& hosts, const std::string& digest = "") {
    zoo_set_debug_level(static_cast<ZooLogLevel>(0));
    handle_ = zookeeper_init(hosts.c_str(), nullptr, 10000, nullptr, nullptr, 0);
    for (int i = 0; i < 100 && zoo_state(handle_) != ZOO_CONNECTED_STATE; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (!digest.empty())
      zoo_add_auth(handle_, "digest", digest.data(), static_cast<int>(digest.size()), nullptr, nullptr);
  }
  ~RawZk() { zookeeper_close(handle_); }
  std::vector<std::string> children(const std::string& path) {
    String_vector names{};
    std::vector<std::string> result;
    if (zoo_get_children(handle_, path.c_str(), 0, &names) != ZOK) return result;
    for (int i = 0; i < names.count; ++i) result.emplace_back(names.data[i]);
    deallocate_String_vector(&names);
    return result;
  }
  // The ACL of a node as "scheme:id/perms" lines.
  std::vector<std::string> acl(const std::string& path) {
    ACL_vector acl{};
    Stat stat{};
    std::vector<std::string> result;
    if (zoo_get_acl(handle_, path.c_str(), &acl, &stat) != ZOK) return result;
    for (int i = 0; i < acl.count; ++i) {
      result.push_back(std::string(acl.data[i].id.scheme) + ":" + acl.data[i].id.id + "/" +
                       std::to_string(acl.data[i].perms));
    }
    deallocate_ACL_vector(&acl);
    return result;
  }
  // ZOK with the node's Stat, ZNONODE, or the call's error.
  int stat(const std::string& path, Stat* stat) { return zoo_exists(handle_, path.c_str(), 0, stat); }
  int remove(const std::string& path) { return zoo_delete(handle_, path.c_str(), -1); }
  int set(const std::string& path, const std::string& data) {
    return zoo_set(handle_, path.c_str(), data.data(), static_cast<int>(data.size()), -1);
  }
  std::string data(const std::string& path) {
    char buffer[1024];
    int length = sizeof buffer;
    if (zoo_get(handle_, path.c_str(), 0, buffer, &length, nullptr) != ZOK || length < 0) return {};
    return std::string(buffer, static_cast<std::size_t>(length));
  }

 private:
  zhandle_t* handle_ = nullptr;
};

}  // namespace zookeeper_tests
