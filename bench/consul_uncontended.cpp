// SPDX-License-Identifier: Apache-2.0
// Uncontended lock+unlock per second on the consul:// backend against its limit: api.Lock's own
// two requests (PUT ?acquire=SESSION, PUT ?release=SESSION, with LockFlagValue) on one
// kept-alive libcurl connection, against the same server in the same run (bench/consul_run.sh).
//   turnstile_bench_consul raw|turnstile consul://127.0.0.1:PORT [SECONDS]
#include <curl/curl.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include <nlohmann/json.hpp>
#include <turnstile/turnstile.hpp>

#include "per_second.hpp"

namespace {

// One kept-alive connection, as api.Lock's HTTP client keeps one.
class Raw {
 public:
  explicit Raw(std::string base) : base_(std::move(base)), curl_(curl_easy_init()) {
    curl_easy_setopt(
        curl_, CURLOPT_WRITEFUNCTION, +[](char* data, size_t size, size_t n, void* out) {
          static_cast<std::string*>(out)->append(data, size * n);
          return size * n;
        });
    curl_easy_setopt(curl_, CURLOPT_WRITEDATA, &body_);
    curl_easy_setopt(curl_, CURLOPT_CUSTOMREQUEST, "PUT");
  }
  ~Raw() { curl_easy_cleanup(curl_); }
  std::string put(const std::string& path, const std::string& data = "") {
    body_.clear();
    curl_easy_setopt(curl_, CURLOPT_URL, (base_ + path).c_str());
    curl_easy_setopt(curl_, CURLOPT_POSTFIELDS, data.c_str());
    curl_easy_setopt(curl_, CURLOPT_POSTFIELDSIZE, static_cast<long>(data.size()));
    if (curl_easy_perform(curl_) != CURLE_OK) throw std::runtime_error("request failed: " + path);
    return body_;
  }

 private:
  std::string base_;
  CURL* curl_;
  std::string body_;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s raw|turnstile consul://127.0.0.1:PORT [SECONDS]\n", argv[0]);
    return 64;
  }
  const std::string mode = argv[1];
  const std::string url = argv[2];
  const double seconds = argc > 3 ? std::atof(argv[3]) : 3.0;
  const std::string name = "bench/uncontended-" + mode;
  double rate = 0;
  if (mode == "raw") {
    curl_global_init(CURL_GLOBAL_DEFAULT);
    auto address = url.substr(std::string("consul://").size());
    address = address.substr(0, address.find('?'));
    Raw raw("http://" + address);
    const auto session = nlohmann::json::parse(raw.put("/v1/session/create",
                                                       R"({"TTL":"15s","LockDelay":"0s","Behavior":"delete"})"))["ID"]
                             .get<std::string>();
    const std::string flags = "&flags=3304740253564472344";  // api.Lock's LockFlagValue
    const auto acquire = "/v1/kv/" + name + "?acquire=" + session + flags;
    const auto release = "/v1/kv/" + name + "?release=" + session + flags;
    rate = per_second(seconds, [&] {
      if (raw.put(acquire) != "true" || raw.put(release) != "true") throw std::runtime_error("refused");
    });
    raw.put("/v1/session/destroy/" + session);
  } else {
    auto client = turnstile::Client::connect(url);
    auto mutex = client.mutex(name);
    rate = per_second(seconds, [&] {
      mutex.lock();
      mutex.unlock();
    });
  }
  std::printf("%.0f\n", rate);
  return 0;
}
