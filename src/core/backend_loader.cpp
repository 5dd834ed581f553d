// SPDX-License-Identifier: Apache-2.0
// The scheme table and the loading of backend libraries (backend_loader.hpp).
#include "core/backend_loader.hpp"

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "turnstile/error.hpp"

namespace turnstile::detail {
namespace {

struct BackendKind {
  std::string_view scheme;
  std::string_view family;  // libturnstile-<family>.so
  BackendFactory built_in;  // nullptr: loaded from the family's library
  bool usable_after_fork;
};

constexpr std::array<BackendKind, 12> kBackends{{
    {"file", "file", &make_file_backend, true},
    {"redis", "redis", nullptr, false},
    {"rediss", "redis", nullptr, false},
    {"redis+sentinel", "redis", nullptr, false},
    {"rediss+sentinel", "redis", nullptr, false},
    {"redis+cluster", "redis", nullptr, false},
    {"rediss+cluster", "redis", nullptr, false},
    {"zk", "zookeeper", nullptr, false},
    {"etcd", "etcd", nullptr, false},
    {"etcds", "etcd", nullptr, false},
    {"consul", "consul", nullptr, false},
    {"consuls", "consul", nullptr, false},
}};

// Network backends live in their own shared libraries so the embedded path never pays for
// their dependencies: libturnstile-<family>.so in the private directory turnstile/ beside this
// library (installed), next to it (the build tree), or on the loader path. One thread at a
// time, under a lock every tool sees: glibc runs a library's static initializers under its
// own loader lock, which ThreadSanitizer does not see, so it reported a second thread's
// connect reading a script string the first thread's dlopen was constructing. Found
// factories are kept: one dlopen per family.
// RTLD_LAZY: the libraries a module brings (gRPC, protobuf: some 8,000 function slots) bind a
// function on its first call, as they do in any program linked with them, instead of all at
// once: eager binding was 17 % of the instructions of a whole `turnstile run` on etcd. The
// modules themselves are linked with -z now (CMakeLists.txt), so a module that needs a symbol
// the core lacks still fails here, at load, rather than at a call.
BackendFactory load_backend(std::string_view family) {
  static std::mutex mutex;
  static std::map<std::string, BackendFactory, std::less<>> loaded;
  std::lock_guard lock(mutex);
  if (const auto found = loaded.find(family); found != loaded.end()) return found->second;
  const std::string file = "libturnstile-" + std::string(family) + ".so";
  std::vector<std::string> candidates;
  Dl_info self{};
  if (dladdr(reinterpret_cast<void*>(&load_backend), &self) && self.dli_fname) {
    const auto here = std::filesystem::path(self.dli_fname).parent_path();
    candidates.push_back((here / "turnstile" / file).string());
    candidates.push_back((here / file).string());
  }
  candidates.push_back(file);
  for (const auto& path : candidates) {
    if (void* handle = dlopen(path.c_str(), RTLD_LAZY | RTLD_LOCAL)) {
      if (void* symbol = dlsym(handle, "turnstile_backend_factory_v2")) {
        return loaded[std::string(family)] = reinterpret_cast<BackendFactory>(symbol);
      }
      dlclose(handle);
    }
  }
  return nullptr;
}

}  // namespace

ConnectedBackend connect_backend(const BackendUrl& url, const ClientOptions& options) {
  const auto kind = std::find_if(kBackends.begin(), kBackends.end(),
                                 [&](const BackendKind& entry) { return entry.scheme == url.scheme; });
  if (kind == kBackends.end()) {
    // Every scheme of the table, so the message never falls behind it.
    std::string expected;
    for (std::size_t i = 0; i < kBackends.size(); ++i) {
      expected += std::string(i == 0                      ? ""
                              : i + 1 == kBackends.size() ? " or "
                                                          : ", ") +
                  std::string(kBackends[i].scheme);
    }
    throw InvalidUrl("unknown backend scheme '" + url.scheme + "' in '" + url.text + "' (expected " + expected + ")");
  }
  auto factory = kind->built_in ? kind->built_in : load_backend(kind->family);
  if (!factory) {
    const std::string family(kind->family);
    throw BackendNotBuilt("the " + family + " backend for '" + url.scheme + "://' is not installed (libturnstile-" +
                          family + ".so not found; Debian: the libturnstile-" + family + "0 package)");
  }
  // Made first: the backend reports its connections from its factory on.
  auto telemetry = std::make_shared<Telemetry>(std::string(kind->family), options.metrics_name_label, options.on_event);
  OwnedBackend backend(factory(url, options, telemetry->backend_reports()).release(), BackendDeleter(telemetry));
  return {std::move(backend), kind->usable_after_fork, std::move(telemetry)};
}

}  // namespace turnstile::detail
