// What only the embedded file:// backend promises: a private directory, refusal of foreign or
// symlinked directories, safe mapping of any valid name to files, and loss signalled when the
// directory is removed under a holder.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <stop_token>
#include <set>
#include <thread>

#include <turnstile/turnstile.hpp>

namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using turnstile::Client;
using Clock = std::chrono::steady_clock;

class FileBackend : public ::testing::Test {
 protected:
  void SetUp() override {
    char dir[] = "/tmp/turnstile-file-backend-XXXXXX";
    ASSERT_NE(mkdtemp(dir), nullptr);
    scratch_ = dir;
  }
  void TearDown() override {
    std::error_code ignored;
    // A directory chowned away must come back to us before removal works everywhere.
    fs::remove_all(scratch_, ignored);
  }
  std::string path(const std::string& leaf) const { return scratch_ + "/" + leaf; }
  static std::string url_of(const std::string& dir) { return "file://" + dir; }

  // Every path under `dir`, recursively.
  static std::set<std::string> listing(const std::string& dir) {
    std::set<std::string> out;
    std::error_code error;
    for (fs::recursive_directory_iterator it(dir, error), end; !error && it != end; it.increment(error)) {
      out.insert(it->path().string());
    }
    return out;
  }

  static bool eventually(const std::function<bool()>& predicate, std::chrono::milliseconds timeout) {
    const auto deadline = Clock::now() + timeout;
    while (!predicate()) {
      if (Clock::now() >= deadline) return predicate();
      std::this_thread::sleep_for(5ms);
    }
    return true;
  }

  std::string scratch_;
};

// Sets or unsets an environment variable for one scope.
class EnvOverride {
 public:
  EnvOverride(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) saved_ = old;
    if (value) {
      setenv(name, value, 1);
    } else {
      unsetenv(name);
    }
  }
  ~EnvOverride() {
    if (saved_) {
      setenv(name_, saved_->c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::optional<std::string> saved_;
};

// 209 bytes, 84 of them two-byte characters: its encoded file name would be far too long.
std::string long_multibyte_name() {
  std::string name(40, 'e');
  for (int i = 0; i < 84; ++i) name += "\xc3\xa9";
  return name + "e";
}

mode_t mode_of(const std::string& path) {
  struct stat st {};
  if (lstat(path.c_str(), &st) != 0) return 0;
  return st.st_mode & 07777;
}

TEST_F(FileBackend, CreatesMissingDirectoriesPrivate) {
  const auto root = path("a/b/turnstile");
  auto client = Client::connect(url_of(root));
  EXPECT_TRUE(fs::is_directory(root));
  EXPECT_EQ(mode_of(root), 0700u);
  EXPECT_EQ(mode_of(path("a")), 0700u);
  EXPECT_EQ(mode_of(path("a/b")), 0700u);
  auto mutex = client.mutex("x");
  EXPECT_TRUE(mutex.try_lock());
  mutex.unlock();
}

TEST_F(FileBackend, DefaultDirectoryFollowsXdgRuntimeDir) {
  EnvOverride backend("TURNSTILE_BACKEND", nullptr);
  {
    EnvOverride runtime("XDG_RUNTIME_DIR", path("run dir").c_str());
    fs::create_directory(path("run dir"));
    const auto url = Client::default_url();
    EXPECT_EQ(url.rfind("file://", 0), 0u) << url;
    EXPECT_NE(url.find("turnstile"), std::string::npos) << url;
    auto client = Client::connect();
    const auto root = path("run dir/turnstile");
    EXPECT_TRUE(fs::is_directory(root)) << "connect() did not use " << root << " (url " << client.url() << ")";
    EXPECT_EQ(mode_of(root), 0700u);
    auto mutex = client.mutex("x");
    EXPECT_TRUE(mutex.try_lock());
    mutex.unlock();
  }
  {
    EnvOverride runtime("XDG_RUNTIME_DIR", nullptr);
    EXPECT_EQ(Client::default_url(), "file:///tmp/turnstile-" + std::to_string(geteuid()));
  }
}

TEST_F(FileBackend, RefusesADirectoryOwnedByAnotherUser) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to give a directory away";
  const auto root = path("foreign");
  ASSERT_EQ(mkdir(root.c_str(), 0700), 0);
  ASSERT_EQ(chown(root.c_str(), 65534, 65534), 0);
  try {
    Client::connect(url_of(root));
    FAIL() << "connected to a directory owned by uid 65534";
  } catch (const turnstile::Error& error) {
    EXPECT_EQ(error.code(), turnstile::ErrorCode::access_denied) << error.what();
  }
  EXPECT_TRUE(fs::is_empty(root));
}

TEST_F(FileBackend, RefusesADirectoryReachedThroughASymlink) {
  const auto real = path("real");
  const auto link = path("link");
  ASSERT_EQ(mkdir(real.c_str(), 0700), 0);
  ASSERT_EQ(symlink(real.c_str(), link.c_str()), 0);
  EXPECT_THROW(Client::connect(url_of(link)), turnstile::Error);
  EXPECT_THROW(Client::connect(url_of(link + "/")), turnstile::Error);
  EXPECT_TRUE(fs::is_empty(real));
  EXPECT_NO_THROW(Client::connect(url_of(real)));
}

TEST_F(FileBackend, RefusesAStateFileReplacedByASymlink) {
  const auto root = path("root");
  const auto victim = path("victim");
  {
    std::ofstream(victim) << "precious";
  }
  std::set<std::string> before;
  {
    auto client = Client::connect(url_of(root));
    before = listing(root);
    auto mutex = client.mutex("target");
    mutex.lock();
    mutex.unlock();
  }
  // Replace every file the name created with a symlink to the victim.
  const auto after = listing(root);
  int replaced = 0;
  for (const auto& file : after) {
    if (before.count(file) || !fs::is_regular_file(fs::symlink_status(file))) continue;
    fs::remove(file);
    fs::create_symlink(victim, file);
    ++replaced;
  }
  ASSERT_GT(replaced, 0) << "locking created no file";
  auto client = Client::connect(url_of(root));
  try {
    auto mutex = client.mutex("target");
    if (mutex.try_lock()) mutex.unlock();
  } catch (const turnstile::Error&) {
    // refusing is fine
  }
  std::ifstream in(victim);
  std::string content;
  std::getline(in, content);
  EXPECT_EQ(content, "precious");
  EXPECT_EQ(fs::file_size(victim), 8u);
}

TEST_F(FileBackend, UnusualNamesWork) {
  const auto root = path("root");
  auto client = Client::connect(url_of(root));
  auto other = Client::connect(url_of(root));
  const std::vector<std::string> names{
      "with space",
      "braces{}/[brackets]/(parens)",
      "quotes'\"`",
      "\xc3\xbc\xc3\xb1\xc3\xaf/\xe6\x97\xa5\xe6\x9c\xac/\xf0\x9f\x94\x92",
      "%41",
      "A",
      "a%2Fb",
      "a/b",
      "a_b",
      "a b",
      "Case",
      "case",
      "-leading-dash",
      "*?<>|\\:;&$!#~=+,@^",
      std::string(255, 'x'),
      std::string(254, 'x') + "y",
      long_multibyte_name(),  // long once encoded
  };
  // Each name excludes itself and nothing else: hold them all at once from one client...
  std::vector<turnstile::Mutex> held;
  for (const auto& name : names) {
    held.push_back(client.mutex(name));
    EXPECT_TRUE(held.back().try_lock()) << "could not lock '" << name << "': it collides with another name";
  }
  // ...and the other client is refused every one of them.
  for (const auto& name : names) {
    auto mutex = other.mutex(name);
    EXPECT_FALSE(mutex.try_lock()) << "'" << name << "' did not exclude";
    const auto inspection = other.inspect(name);
    EXPECT_EQ(inspection.name, name);
    EXPECT_EQ(inspection.holders.size(), 1u) << name;
  }
  for (auto& mutex : held) mutex.unlock();
  for (const auto& name : names) {
    auto mutex = other.mutex(name);
    EXPECT_TRUE(mutex.try_lock()) << name;
    mutex.unlock();
  }
  // Everything stayed inside the root, and no name became a directory of its own outside it.
  for (const auto& file : listing(scratch_)) {
    EXPECT_EQ(file.rfind(root, 0), 0u) << file << " is outside the backend directory";
  }
}

TEST_F(FileBackend, BadNamesLeaveTheDirectoryUntouched) {
  const auto root = path("root");
  auto client = Client::connect(url_of(root));
  const auto before = listing(scratch_);
  const std::vector<std::string> bad_names{"", "..", "../x", "a/../../x", "/etc/passwd", "a//b", "x\n",
                                           std::string(256, 'a')};
  for (const auto& bad : bad_names) {
    EXPECT_THROW(client.mutex(bad), turnstile::InvalidArgument);
    EXPECT_THROW(client.semaphore(bad, 1), turnstile::InvalidArgument);
    EXPECT_THROW(client.permit_counter(bad), turnstile::InvalidArgument);
    EXPECT_THROW(client.inspect(bad), turnstile::InvalidArgument);
  }
  EXPECT_EQ(listing(scratch_), before);
}

TEST_F(FileBackend, UrlForms) {
  const auto root = path("root");
  EXPECT_NO_THROW(Client::connect("file://localhost" + root));
  EXPECT_NO_THROW(Client::connect(url_of(root + "/")));
  EXPECT_THROW(Client::connect("file://otherhost" + root), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect(url_of(root) + "?ttl=5"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("file:"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("file://"), turnstile::InvalidUrl);
  // Percent-encoded paths decode.
  EXPECT_NO_THROW(Client::connect(url_of(path("with%20space"))));
  EXPECT_TRUE(fs::is_directory(path("with space")));
  // '.' and '..' segments are refused before anything is created.
  EXPECT_THROW(Client::connect(url_of(path("a/../b"))), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect(url_of(path("./c"))), turnstile::InvalidUrl);
  EXPECT_FALSE(fs::exists(path("a")));
  EXPECT_FALSE(fs::exists(path("b")));
}

TEST_F(FileBackend, RemovingTheDirectorySignalsLoss) {
  const auto root = path("root");
  std::atomic<int> lost_callbacks{0};
  std::mutex messages_mutex;
  std::vector<std::string> messages;
  turnstile::ClientOptions options;
  options.on_hold_lost = [&](const turnstile::Error& error) {
    EXPECT_EQ(error.code(), turnstile::ErrorCode::hold_lost);
    std::lock_guard lock(messages_mutex);
    messages.push_back(error.what());
    ++lost_callbacks;
  };
  std::vector<turnstile::ErrorCode> reported;
  options.error_handler = [&](const turnstile::Error& error) {
    std::lock_guard lock(messages_mutex);
    reported.push_back(error.code());
  };
  auto client = Client::connect(url_of(root), options);
  auto mutex = client.mutex("held/mutex");
  auto unlocked = client.mutex("held/unlocked");
  auto shared = client.shared_mutex("held/reader");
  auto semaphore = client.semaphore("held/semaphore", 2);
  mutex.lock();
  unlocked.lock();
  shared.lock_shared();
  auto lease = semaphore.acquire();
  const std::vector<std::stop_token> tokens{mutex.lost_token(), unlocked.lost_token(), shared.lost_token(),
                                           lease.lost_token()};
  for (const auto& token : tokens) EXPECT_FALSE(token.stop_requested());

  fs::remove_all(root);
  const auto start = Clock::now();
  EXPECT_TRUE(eventually(
      [&] {
        for (const auto& token : tokens) {
          if (!token.stop_requested()) return false;
        }
        return true;
      },
      5s))
      << "a hold whose directory was removed was not told within 5 s";
  EXPECT_LT(Clock::now() - start, 5s);
  EXPECT_TRUE(eventually([&] { return lost_callbacks.load() == 4; }, 2s)) << lost_callbacks.load();
  {
    std::lock_guard lock(messages_mutex);
    for (const auto& message : messages) {
      EXPECT_NE(message.find("held/"), std::string::npos) << message;
    }
  }
  // Releasing a lost hold reports it; unlock() hands it to the error handler.
  EXPECT_THROW(mutex.release(), turnstile::HoldLost);
  EXPECT_THROW(lease.release(), turnstile::HoldLost);
  EXPECT_THROW(shared.release_shared(), turnstile::HoldLost);
  EXPECT_NO_THROW(unlocked.unlock());
  {
    std::lock_guard lock(messages_mutex);
    ASSERT_EQ(reported.size(), 1u);
    EXPECT_EQ(reported.back(), turnstile::ErrorCode::hold_lost);
  }
}

// After the directory is gone, the old client must not hand out holds that exclude nobody:
// a new client works on a fresh directory, so two "holders" would coexist.
TEST_F(FileBackend, AClientWhoseDirectoryWasRemovedDoesNotGrantSilentHolds) {
  const auto root = path("root");
  auto old_client = Client::connect(url_of(root));
  {
    auto mutex = old_client.mutex("x");
    mutex.lock();
    mutex.unlock();
  }
  fs::remove_all(root);
  auto new_client = Client::connect(url_of(root));
  auto fresh = new_client.mutex("x");
  ASSERT_TRUE(fresh.try_lock());
  auto stale = old_client.mutex("x");
  bool acquired = false;
  try {
    acquired = stale.try_lock();
  } catch (const turnstile::Error& error) {
    // Refusing is one correct answer.
    SUCCEED() << error.what();
  }
  if (acquired) {
    // The other correct answer is a hold already known to be lost when it is granted.
    const auto lost = stale.lost_token();
    if (!lost.stop_requested()) {
      const bool later = eventually([&] { return lost.stop_requested(); }, 3s);
      ADD_FAILURE() << "two clients hold 'x' at once and the stale one was not told it is lost when granted"
                    << (later ? " (it was told later, by the background check)" : " (nor within 3 s)");
    }
    stale.unlock();
  }
  fresh.unlock();
}

}  // namespace
