// SPDX-License-Identifier: Apache-2.0
// Fencing with a real store: a SQLite table that accepts a write only with a fencing token at
// least as new as the last one it accepted, checked and recorded in the same transaction as the
// write itself.
//
//   ./example_fencing_sqlite [BACKEND_URL [DATABASE]]   (default: Client::connect(), a temp file)
//
// A lock alone cannot stop a holder that was paused (a GC pause, SIGSTOP, a VM freeze) past its
// TTL: when it runs again, another process may hold the lock and have written since. Its token is
// then lower than the newer holder's, and the store turns the late write away. Here the pause is
// played by keeping the first holder's token after its hold ended, which is what a paused holder
// has in hand when it resumes.
#include <turnstile/turnstile.hpp>

#include <sqlite3.h>

#include <unistd.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>

namespace {

// The protected resource. `fence` keeps, per resource, the highest token accepted so far.
class FencedStore {
 public:
  explicit FencedStore(const std::string& path) {
    if (sqlite3_open(path.c_str(), &db_) != SQLITE_OK) throw std::runtime_error(sqlite3_errmsg(db_));
    exec("CREATE TABLE IF NOT EXISTS fence (resource TEXT PRIMARY KEY, token INTEGER NOT NULL)");
    exec("CREATE TABLE IF NOT EXISTS report (resource TEXT PRIMARY KEY, body TEXT NOT NULL)");
  }
  ~FencedStore() { sqlite3_close(db_); }

  // Writes `body` unless a newer token was accepted already (then nothing changes: false).
  bool write(const std::string& resource, std::uint64_t token, const std::string& body) {
    exec("BEGIN IMMEDIATE");  // one writer at a time inside SQLite: check and write are atomic
    // The token goes in only if it is not lower than the one recorded (an upsert with a WHERE
    // on its update): sqlite3_changes() tells whether it did.
    statement(
        "INSERT INTO fence (resource, token) VALUES (?1, ?2) "
        "ON CONFLICT (resource) DO UPDATE SET token = excluded.token WHERE excluded.token >= fence.token",
        resource, static_cast<sqlite3_int64>(token));
    if (sqlite3_changes(db_) == 0) {
      exec("ROLLBACK");
      return false;
    }
    statement(
        "INSERT INTO report (resource, body) VALUES (?1, ?2) "
        "ON CONFLICT (resource) DO UPDATE SET body = excluded.body",
        resource, body);
    exec("COMMIT");
    return true;
  }

 private:
  void exec(const char* sql) {
    if (sqlite3_exec(db_, sql, nullptr, nullptr, nullptr) != SQLITE_OK) throw std::runtime_error(sqlite3_errmsg(db_));
  }
  template <typename Value>
  void statement(const char* sql, const std::string& text, const Value& value) {
    sqlite3_stmt* raw = nullptr;
    if (sqlite3_prepare_v2(db_, sql, -1, &raw, nullptr) != SQLITE_OK) throw std::runtime_error(sqlite3_errmsg(db_));
    std::unique_ptr<sqlite3_stmt, int (*)(sqlite3_stmt*)> prepared(raw, sqlite3_finalize);
    sqlite3_bind_text(raw, 1, text.c_str(), -1, SQLITE_TRANSIENT);
    if constexpr (std::is_same_v<Value, std::string>) {
      sqlite3_bind_text(raw, 2, value.c_str(), -1, SQLITE_TRANSIENT);
    } else {
      sqlite3_bind_int64(raw, 2, value);
    }
    if (sqlite3_step(raw) != SQLITE_DONE) throw std::runtime_error(sqlite3_errmsg(db_));
  }
  sqlite3* db_ = nullptr;
};

}  // namespace

int main(int argc, char** argv) try {
  auto client = argc > 1 ? turnstile::Client::connect(argv[1]) : turnstile::Client::connect();
  const std::string path = argc > 2 ? argv[2] : "/tmp/turnstile-fencing-example-" + std::to_string(getpid()) + ".db";
  FencedStore store(path);
  auto mutex = client.mutex("reports/daily");

  // Worker A holds the lock and takes its token, then stalls past its TTL: its hold ends.
  mutex.lock();
  const std::uint64_t paused_token = mutex.fencing_token();
  mutex.unlock();

  // Meanwhile worker B gets the lock (a strictly greater token) and writes.
  std::uint64_t newer_token = 0;
  {
    std::lock_guard guard(mutex);
    newer_token = mutex.fencing_token();
    std::printf("B writes with token %llu: %s\n", static_cast<unsigned long long>(newer_token),
                store.write("daily", newer_token, "written by B") ? "accepted" : "rejected");
  }

  // A resumes and writes with the token it still has: the store turns it away.
  const bool stale_accepted = store.write("daily", paused_token, "written by A after its pause");
  std::printf("A writes with its old token %llu: %s\n", static_cast<unsigned long long>(paused_token),
              stale_accepted ? "accepted (never happens)" : "rejected, as it must be");
  if (argc <= 2) std::remove(path.c_str());
  return stale_accepted || newer_token <= paused_token ? EXIT_FAILURE : EXIT_SUCCESS;
} catch (const turnstile::Error& error) {  // a bad URL, a server that cannot be reached, ...
  std::fprintf(stderr, "%s\n", error.what());
  return error.code() == turnstile::ErrorCode::invalid_url ? 64 : 69;  // EX_USAGE, EX_UNAVAILABLE
}
