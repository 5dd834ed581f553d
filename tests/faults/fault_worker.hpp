// SPDX-License-Identifier: Apache-2.0
// The client processes of a fault run (fault_worker.cpp).
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

namespace turnstile::faults {

struct WorkerOptions {
  std::string url;
  std::chrono::milliseconds ttl{2000};
  std::chrono::milliseconds acquire_timeout{10000};
  std::string prefix;  // of the run's names
  int names_per_kind = 2;
  std::string out_dir;    // hold histories and event logs
  std::string store_dir;  // the fenced store
  int id = 0;
  std::uint64_t seed = 1;
  // A client that keeps using a hold without looking whether it is still held (what the
  // checks must catch; `run --clients-ignore-loss` proves they do).
  bool ignore_loss = false;
};

// A library client: holds of every primitive until SIGTERM.
int worker_main(const WorkerOptions& options);
// A CLI client: `turnstile run --lock` in a loop until SIGTERM, running cli-child.
int cli_worker_main(const WorkerOptions& options, const std::string& cli_path, const std::string& self_path);
// What the CLI client runs under its hold: one fenced write, a pause, a hold record.
int cli_child_main(const std::string& history_path, const std::string& events_path, const std::string& store_dir,
                   std::chrono::milliseconds length);

}  // namespace turnstile::faults
