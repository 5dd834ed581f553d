// SPDX-License-Identifier: Apache-2.0
// The libcurl pieces every request to Consul is made of (curl_transfer.cpp): a multi handle
// whose own sockets are close-on-exec, and one request's easy handle set up for an Endpoint
// (the ACL token in a header only, a timeout, close-on-exec sockets). Used by the calls of
// http.cpp and by the shared blocking queries of blocking_queries.cpp.
#pragma once

#include <curl/curl.h>

#include <chrono>

#include "backends/consul/http.hpp"

namespace turnstile::detail::consul {

// curl_multi_init, with the wake-up socketpair it makes marked close-on-exec.
CURLM* new_multi();

// One request on its easy handle (owned when `owns_easy`), with its headers and its answer.
struct Transfer {
  CURL* easy = nullptr;
  bool owns_easy = false;
  curl_slist* headers = nullptr;
  Reply reply;
  bool running = false;
  Transfer() = default;
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;
  ~Transfer() {
    curl_slist_free_all(headers);
    if (owns_easy) curl_easy_cleanup(easy);
  }
};

// Resets `transfer.easy` and sets it up to send `request` within `timeout`. The request's body
// must outlive the transfer (libcurl does not copy POSTFIELDS).
void prepare(Transfer& transfer, const Endpoint& endpoint, const Request& request, std::chrono::milliseconds timeout);

}  // namespace turnstile::detail::consul
