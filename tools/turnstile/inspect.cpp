// SPDX-License-Identifier: Apache-2.0
// `turnstile inspect`: the holders and waiters of a name, as a table or one JSON object (schema:
// docs/inspect-json.md), once or again whenever they change (--watch).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "commands.hpp"
#include "common.hpp"
#include "core/text_escape.hpp"
#include "inspect_list.hpp"
#include "namespace_notice.hpp"
#include "text_table.hpp"

namespace turnstile::cli {
namespace {

// The version of the JSON that --json prints; raised when a field changes meaning or goes away
// (new fields may appear within a version).
constexpr int kJsonSchemaVersion = 1;

// A backend that does not know when an entry started leaves the epoch: shown as unknown, never
// as 1970-01-01 (and pid 0 likewise).
bool known(std::chrono::system_clock::time_point since) { return since.time_since_epoch().count() != 0; }

// `election`: the queue is an election's, whose entries carry their candidates' values.
nlohmann::ordered_json entries_json(const std::vector<EntryInfo>& entries, bool election) {
  auto out = nlohmann::ordered_json::array();
  for (const auto& e : entries) {
    const bool foreign = !e.foreign.empty();
    out.push_back({{"fencing_token", e.fencing_token},
                   {"kind", e.kind},
                   {"permits", e.permits},
                   {"pid", foreign || e.pid == 0 ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(e.pid)},
                   {"host", foreign ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(e.host)},
                   {"since", foreign || !known(e.since) ? nlohmann::ordered_json(nullptr)
                                                        : nlohmann::ordered_json(iso8601(e.since))},
                   {"label", e.label.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(e.label)},
                   {"foreign", foreign ? nlohmann::ordered_json(e.foreign) : nlohmann::ordered_json(nullptr)},
                   {"kept_until",
                    e.kept_until ? nlohmann::ordered_json(iso8601(*e.kept_until)) : nlohmann::ordered_json(nullptr)},
                   {"value", election ? nlohmann::ordered_json(e.value) : nlohmann::ordered_json(nullptr)}});
  }
  return out;
}

// `time`: when the look was made (every --watch --json line carries it), else null.
std::string render_json(const std::string& backend, const Inspection& q,
                        std::optional<std::chrono::system_clock::time_point> time) {
  nlohmann::ordered_json out = {
      {"schema_version", kJsonSchemaVersion},
      {"backend", backend},
      {"time", time ? nlohmann::ordered_json(iso8601(*time)) : nlohmann::ordered_json(nullptr)},
      {"name", q.name},
      {"mode", q.mode},
      {"limit", q.mode == "semaphore" ? nlohmann::ordered_json(q.limit) : nlohmann::ordered_json(nullptr)},
      {"permits", q.permits ? nlohmann::ordered_json(*q.permits) : nlohmann::ordered_json(nullptr)},
      {"holders", entries_json(q.holders, q.mode == "election")},
      {"waiters", entries_json(q.waiters, q.mode == "election")}};
  // Bytes that are not UTF-8 (a peer may write anything) become U+FFFD instead of an exception;
  // control characters are escaped by JSON itself.
  return out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace) + "\n";
}

// What one look found: the backend read (URL with credentials redacted, and a note on where it
// came from), and the queue, or without NAME the names in use.
struct Look {
  std::string url;
  std::string note;  // " (the default)", " (TURNSTILE_BACKEND)", ", no such directory ..."
  Inspection queue;
  std::optional<NamesInUse> names;  // set when listing
};

// The HOST column of a row: a holder that is not turnstile's has no pid, host or start time we
// could know, only what its foreign note says.
std::string host_cell(const EntryInfo& e) {
  auto host = e.foreign.empty() ? printable(e.host) : "foreign: " + printable(e.foreign);
  // Released with --hold-at-least: its holder may be gone, the entry holds on until then.
  if (e.kept_until) host += " (kept until " + iso8601(*e.kept_until) + ")";
  return host;
}

std::string render_table(const std::string& backend, const Inspection& q) {
  std::string out;
  char line[1024];
  const auto add = [&](const char* format, auto... values) {
    std::snprintf(line, sizeof line, format, values...);
    out += line;
  };
  out += "backend  " + printable(backend) + "\n";
  out += "name     " + printable(q.name) + "\n";
  if (q.mode.empty()) {
    out += "mode     (nobody queued)\n";
  } else if (q.mode == "semaphore") {
    add("mode     semaphore, limit %lld\n", static_cast<long long>(q.limit));
  } else {
    out += "mode     " + printable(q.mode) + "\n";
  }
  if (q.permits) add("permits  %lld\n", static_cast<long long>(*q.permits));
  if (q.holders.empty() && q.waiters.empty()) return out;
  std::vector<std::vector<std::string>> rows{{"ROLE", "TOKEN", "KIND", "PERMITS", "SINCE", "PID", "HOST", "LABEL"}};
  const auto add_rows = [&](const char* role, const std::vector<EntryInfo>& entries) {
    for (const auto& e : entries) {
      const bool foreign = !e.foreign.empty();
      rows.push_back({role, std::to_string(e.fencing_token), printable(e.kind), std::to_string(e.permits),
                      foreign || !known(e.since) ? "-" : iso8601(e.since),
                      foreign || e.pid == 0 ? "-" : std::to_string(e.pid), host_cell(e),
                      e.label.empty() ? "-" : "\"" + printable(e.label) + "\""});
    }
  };
  add_rows("holder", q.holders);
  add_rows("waiter", q.waiters);
  // TOKEN fits any 64-bit token (20 digits) and PERMITS any count (at most 10^12), so that
  // tables of one name keep their shape from look to look (--watch).
  return out + aligned_rows(rows, {{8}, {20}, {10}, {13}, {25}, {8}, {4}, {0}}, 1);
}

// The directory of a plain file:// URL — file:///DIR or file://localhost/DIR, percent-escapes
// decoded — or nullopt for anything else (parameters, '.' or '..', another scheme), which the
// library judges when it connects.
std::optional<std::string> plain_file_directory(std::string_view url) {
  constexpr std::string_view kScheme = "file://";
  if (!url.starts_with(kScheme)) return std::nullopt;
  url.remove_prefix(kScheme.size());
  if (url.starts_with("localhost/")) url.remove_prefix(std::string_view("localhost").size());
  if (!url.starts_with('/') || url.find_first_of("?#") != std::string_view::npos) return std::nullopt;
  auto decoded = detail::percent_decode(url);
  if (!decoded) return std::nullopt;
  const std::string path = std::move(*decoded);
  if (path.find('\0') != std::string::npos) return std::nullopt;
  for (std::size_t start = 1; start < path.size();) {
    const auto end = std::min(path.find('/', start), path.size());
    const auto segment = std::string_view(path).substr(start, end - start);
    if (segment == "." || segment == "..") return std::nullopt;
    start = end + 1;
  }
  return path;
}

// Reads the queue of one name, again and again for --watch: connects once (again after a
// failed connect). On file:// it never creates the directory (connecting would): a directory
// that does not exist has nobody queued in it, and is looked at each time until it appears.
class Reader {
  static constexpr const char* kFromEnvironment = " (TURNSTILE_BACKEND)";

 public:
  explicit Reader(const InspectOptions& options)
      : name_(options.name), prefix_(options.prefix.value_or("")), max_names_(options.max_names.value_or(100)) {
    const char* env = std::getenv("TURNSTILE_BACKEND");
    if (options.backend) {
      // file:// names the default: looked at without creating it, as the default is.
      url_ = *options.backend == "file://" ? Client::default_url() : *options.backend;
    } else if (env && *env) {
      url_ = env;
      from_ = kFromEnvironment;
    } else {
      url_ = Client::default_url();
      from_ = " (the default)";
      tell_namespace(url_, false);
    }
    directory_ = plain_file_directory(url_);
    client_options_.connect_timeout = std::max(
        std::chrono::milliseconds(1),
        std::chrono::ceil<std::chrono::milliseconds>(std::chrono::duration<double>(options.connect_timeout_sec)));
  }

  // Throws Error.
  Look look() {
    struct stat st {};
    if (directory_ && lstat(directory_->c_str(), &st) != 0 && errno == ENOENT) {
      client_.reset();  // it went away: connecting again later must not make it again
      if (const auto problem = listing() ? "" : name_problem(name_); !problem.empty()) throw InvalidArgument(problem);
      Inspection nobody;
      nobody.name = name_;
      // A file:// URL carries no credentials: shown as given.
      return {url_, from_ + ", a directory that does not exist (not created)", nobody,
              listing() ? std::optional<NamesInUse>(NamesInUse{}) : std::nullopt};
    }
    if (!client_) {
      try {
        client_.emplace(Client::connect(url_, client_options_));
      } catch (const InvalidUrl& error) {
        if (from_ != kFromEnvironment) throw;
        throw InvalidUrl(std::string(error.what()) + "; the URL came from TURNSTILE_BACKEND");
      }
    }
    if (listing()) {
      return {client_->url(), from_, {}, client_->names_in_use(prefix_, max_names_, SteadyClock::now() + kListingTime)};
    }
    return {client_->url(), from_, client_->inspect(name_), std::nullopt};
  }

  bool listing() const { return name_.empty(); }

 private:
  std::string name_, prefix_;
  std::size_t max_names_;
  std::string url_, from_;
  std::optional<std::string> directory_;
  ClientOptions client_options_;
  std::optional<Client> client_;
};

// `time` goes into JSON only (a table shows it in --watch's footer on a terminal).
std::string render(const InspectOptions& options, const Look& look,
                   std::optional<std::chrono::system_clock::time_point> time) {
  if (look.names) {
    const auto prefix = options.prefix.value_or("");
    return options.json ? render_names_json(look.url, prefix, *look.names, kJsonSchemaVersion, time)
                        : render_names_table(look.url + look.note, prefix, *look.names);
  }
  return options.json ? render_json(look.url, look.queue, time) : render_table(look.url + look.note, look.queue);
}

bool print(const std::string& text) {
  std::fputs(text.c_str(), stdout);
  return std::fflush(stdout) == 0 && !std::ferror(stdout);
}

// --watch: looks every --interval and prints the view again when it changed (a terminal is
// cleared first; JSON is one object per line), until SIGINT, SIGTERM or SIGHUP (exit 0) or
// until nobody reads stdout. Polling is enough for a display; errors that a later look may not
// have (the backend unreachable) are shown and the watch goes on.
int watch(const InspectOptions& options, Reader& reader, const sigset_t& stop_signals) {
  const bool terminal = isatty(STDOUT_FILENO);
  const auto interval = std::chrono::duration<double>(options.interval_sec);
  std::optional<std::string> shown;
  for (;;) {
    std::string text, error, timed;
    try {
      // What changed is judged without the time; what is printed carries it (JSON).
      const auto look = reader.look();
      text = render(options, look, std::nullopt);
      timed = options.json ? render(options, look, std::chrono::system_clock::now()) : text;
    } catch (const Error& e) {
      if (exit_status_for(e) == kExitUsage) {
        complain(e.what());
        return kExitUsage;
      }
      error = e.what();
      text = "error: " + error + "\n";
    }
    if (text != shown) {
      bool ok = true;
      if (options.json && !error.empty()) {
        complain(error);
      } else if (terminal) {
        char every[32];
        std::snprintf(every, sizeof every, "%g", options.interval_sec);
        ok = print("\x1b[H\x1b[2J" + text + "\n(looked at every " + every + " s; last change " +
                   iso8601(std::chrono::system_clock::now()) + "; Ctrl-C ends)\n");
      } else {
        ok = print(shown && !options.json ? "\n" + text : timed);
      }
      if (!ok) return 0;  // nobody reads any more
      shown = text;
    }
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(interval).count();
    const timespec wait{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
    if (sigtimedwait(&stop_signals, nullptr, &wait) > 0) return 0;
  }
}

}  // namespace

int inspect_command(const InspectOptions& options) {
  if (!(std::isfinite(options.connect_timeout_sec) && options.connect_timeout_sec > 0 &&
        options.connect_timeout_sec <= 1e9)) {
    complain("--connect-timeout must be a number of seconds, more than 0 and at most 1e9");
    return kExitUsage;
  }
  if (!(std::isfinite(options.interval_sec) && options.interval_sec >= 0.01 && options.interval_sec <= 3600)) {
    complain("--interval must be a number of seconds, 0.01 to 3600");
    return kExitUsage;
  }
  if (!options.name.empty() && (options.prefix || options.max_names)) {
    complain("--prefix and --max-names list the names in use: give them without NAME");
    return kExitUsage;
  }
  if (options.max_names && (*options.max_names < 1 || *options.max_names > 10'000)) {
    complain("--max-names must be 1 to 10000");
    return kExitUsage;
  }
  // Blocked before any thread exists (a network client starts some), so that they all arrive
  // in watch()'s sigtimedwait.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  if (options.watch) {
    for (int sig : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&stop_signals, sig);
    pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
    ::signal(SIGPIPE, SIG_IGN);
  }
  try {
    Reader reader(options);
    if (options.watch) return watch(options, reader, stop_signals);
    print(render(options, reader.look(), std::chrono::system_clock::now()));
    return 0;
  } catch (const Error& error) {
    complain(error.what());
    return exit_status_for(error);
  }
}

}  // namespace turnstile::cli
