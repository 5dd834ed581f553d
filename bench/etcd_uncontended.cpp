// SPDX-License-Identifier: Apache-2.0
// Uncontended lock+unlock per second on the etcd:// backend against its limit: one Txn round
// trip (put the key if its create revision is 0, read the queue) plus one DeleteRange round
// trip, sent raw over gRPC, on the same server in the same run (bench/etcd_run.sh).
// Two programs from this one file: the raw loop (ETCD_BENCH_RAW, with its own copy of the
// generated stubs) and the turnstile loop (which loads libturnstile-etcd.so, holding the same
// protobuf descriptors: one process cannot register them twice).
//   turnstile_bench_etcd_raw etcd://127.0.0.1:PORT [SECONDS]
//   turnstile_bench_etcd     etcd://127.0.0.1:PORT [SECONDS]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <turnstile/turnstile.hpp>

#include "per_second.hpp"

#ifdef ETCD_BENCH_RAW
#include <grpcpp/grpcpp.h>

#include "rpc.grpc.pb.h"
#endif

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s etcd://127.0.0.1:PORT [SECONDS]\n", argv[0]);
    return 64;
  }
  const std::string url = argv[1];
  const double seconds = argc > 2 ? std::atof(argv[2]) : 3.0;

#ifdef ETCD_BENCH_RAW
  // The raw limit: the same two requests an uncontended acquire and release send.
  auto channel = grpc::CreateChannel(url.substr(std::string("etcd://").size()), grpc::InsecureChannelCredentials());
  auto kv = etcdserverpb::KV::NewStub(channel);
  auto lease_stub = etcdserverpb::Lease::NewStub(channel);
  etcdserverpb::LeaseGrantRequest grant;
  grant.set_ttl(30);
  etcdserverpb::LeaseGrantResponse granted;
  {
    grpc::ClientContext context;
    if (!lease_stub->LeaseGrant(&context, grant, &granted).ok()) {
      std::fprintf(stderr, "cannot reach %s\n", url.c_str());
      return 1;
    }
  }
  const std::string prefix = "bench/raw/";
  const std::string key = prefix + "1";
  std::string prefix_end = prefix;
  prefix_end.back() = static_cast<char>(prefix_end.back() + 1);
  etcdserverpb::TxnRequest put_if_absent;
  auto* compare = put_if_absent.add_compare();
  compare->set_key(key);
  compare->set_target(etcdserverpb::Compare::CREATE);
  compare->set_result(etcdserverpb::Compare::EQUAL);
  compare->set_create_revision(0);
  auto* put = put_if_absent.add_success()->mutable_request_put();
  put->set_key(key);
  put->set_lease(granted.id());
  auto* range = put_if_absent.add_success()->mutable_request_range();
  range->set_key(prefix);
  range->set_range_end(prefix_end);
  range->set_sort_target(etcdserverpb::RangeRequest::CREATE);
  range->set_sort_order(etcdserverpb::RangeRequest::ASCEND);
  etcdserverpb::DeleteRangeRequest remove;
  remove.set_key(key);
  const double raw = per_second(seconds, [&] {
    etcdserverpb::TxnResponse txn_response;
    etcdserverpb::DeleteRangeResponse delete_response;
    grpc::ClientContext txn_context, delete_context;
    if (!kv->Txn(&txn_context, put_if_absent, &txn_response).ok()) std::abort();
    if (!kv->DeleteRange(&delete_context, remove, &delete_response).ok()) std::abort();
  });
  std::printf("%.0f\n", raw);
#else
  auto client = turnstile::Client::connect(url);
  auto mutex = client.mutex("bench/turnstile");
  const double ours = per_second(seconds, [&] {
    mutex.lock();
    mutex.unlock();
  });
  std::printf("%.0f\n", ours);
#endif
  return 0;
}
