// SPDX-License-Identifier: Apache-2.0
// Bad input and misuse: typed errors that change nothing, unlock() that never throws and
// reports to the error handler, release() that reports as a typed error, bad URLs.
#include <cstdlib>
#include <filesystem>
#include <future>
#include <mutex>
#include <shared_mutex>

#include "conformance/support.hpp"

namespace conformance {
namespace {

using turnstile::Client;
using turnstile::ErrorCode;

std::vector<std::string> bad_names() {
  return {
      "",
      std::string(256, 'a'),
      "a//b",
      "/a",
      "a/",
      "/",
      "..",
      ".",
      "a/./b",
      "a/../b",
      "a/..",
      "./a",
      "a\nb",
      "a\tb",
      std::string("a\0b", 3),
      "a\x7f",
      "\x1b[31m",
      "\xff",
      "a\xc3",                             // truncated sequence
      "\xc0\xaf",                          // overlong '/'
      "\xed\xa0\x80",                      // a UTF-16 surrogate
      "\xf4\x90\x80\x80",                  // beyond U+10FFFF
      std::string(254, 'a') + "\xc3\xa9",  // valid UTF-8 but 256 bytes
  };
}

std::string printable(const std::string& name) {
  std::string out;
  for (unsigned char c : name) {
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      char buffer[8];
      std::snprintf(buffer, sizeof buffer, "\\x%02x", c);
      out += buffer;
    }
  }
  return out.size() > 60 ? out.substr(0, 60) + "...(" + std::to_string(name.size()) + " bytes)" : out;
}

// Collects what reaches an error handler.
struct Reports {
  std::mutex mutex;
  std::vector<ErrorCode> codes;
  std::vector<std::string> messages;
  turnstile::ErrorHandler handler() {
    return [this](const turnstile::Error& error) {
      std::lock_guard lock(mutex);
      codes.push_back(error.code());
      messages.push_back(error.what());
    };
  }
  std::size_t size() {
    std::lock_guard lock(mutex);
    return codes.size();
  }
  ErrorCode last() {
    std::lock_guard lock(mutex);
    return codes.back();
  }
};

}  // namespace

TEST_P(Conformance, BadNamesAreRefusedAndChangeNothing) {
  for (const auto& bad : bad_names()) {
    SCOPED_TRACE("name \"" + printable(bad) + "\"");
    EXPECT_THROW(client().mutex(bad), turnstile::InvalidArgument);
    EXPECT_THROW(client().recursive_mutex(bad), turnstile::InvalidArgument);
    EXPECT_THROW(client().shared_mutex(bad), turnstile::InvalidArgument);
    EXPECT_THROW(client().semaphore(bad, 1), turnstile::InvalidArgument);
    EXPECT_THROW(client().semaphore(bad, 0), turnstile::InvalidArgument);
    EXPECT_THROW(client().permit_counter(bad), turnstile::InvalidArgument);
    EXPECT_THROW(client().inspect(bad), turnstile::InvalidArgument);
  }
  // Names under our prefix are untouched (nothing partial was created).
  const auto inspection = client().inspect(name("a"));
  EXPECT_TRUE(inspection.holders.empty());
  EXPECT_EQ(inspection.permits, std::nullopt);
}

TEST_P(Conformance, BadNameErrorsAreTurnstileErrors) {
  try {
    client().mutex("a//b");
    FAIL() << "no exception";
  } catch (const turnstile::Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::invalid_argument);
    EXPECT_NE(std::string(error.what()), "");
  }
}

TEST_P(Conformance, GoodNamesAtTheEdgesWork) {
  // The prefix uses some of the 255 bytes: fill the rest exactly.
  const std::string base = name("");
  const std::vector<std::string> good{
      name("a"),
      name("a/b/c"),
      name("with space"),
      name("a..b"),
      name(".hidden"),
      name("\xc3\xbc\xe6\x97\xa5\xf0\x9f\x94\x92"),
      base + std::string(255 - base.size(), 'z'),
  };
  for (const auto& good_name : good) {
    SCOPED_TRACE("name \"" + printable(good_name) + "\"");
    auto mutex = client().mutex(good_name);
    EXPECT_TRUE(mutex.try_lock());
    EXPECT_EQ(mutex.name(), good_name);
    EXPECT_EQ(holder_count(good_name), 1u);
    mutex.unlock();
    auto lease = client().semaphore(good_name, 1).try_acquire();
    EXPECT_TRUE(lease.has_value());
  }
}

TEST_P(Conformance, UnlockWithoutHoldingGoesToTheErrorHandler) {
  Reports reports;
  turnstile::ClientOptions options;
  options.error_handler = reports.handler();
  auto own = connect(options);
  auto mutex = own.mutex(name("m"));
  EXPECT_NO_THROW(mutex.unlock());
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports.last(), ErrorCode::not_held);

  mutex.lock();
  mutex.unlock();
  EXPECT_EQ(reports.size(), 1u);
  mutex.unlock();  // double unlock
  ASSERT_EQ(reports.size(), 2u);
  EXPECT_EQ(reports.last(), ErrorCode::not_held);

  auto shared = own.shared_mutex(name("rw"));
  EXPECT_NO_THROW(shared.unlock_shared());
  EXPECT_NO_THROW(shared.unlock());
  EXPECT_EQ(reports.size(), 4u);
  shared.lock();
  EXPECT_NO_THROW(shared.unlock_shared());  // holds the write lock, not a read lock
  EXPECT_EQ(reports.size(), 5u);
  EXPECT_TRUE(shared.owns_lock());
  shared.unlock();

  auto recursive = own.recursive_mutex(name("r"));
  EXPECT_NO_THROW(recursive.unlock());
  EXPECT_EQ(reports.size(), 6u);
}

// Issue 24: release() inside a guard (to see its errors as exceptions) must not make the
// guard's destructor report "does not hold"; a stray unlock after that still is misuse.
TEST_P(Conformance, ReleaseInsideAGuardLeavesTheGuardNothingToReport) {
  Reports reports;
  auto own = connect();
  own.set_error_handler(reports.handler());
  auto mutex = own.mutex(name("m"));
  {
    std::lock_guard guard(mutex);
    mutex.release();
    EXPECT_FALSE(mutex.owns_lock());
  }
  {
    std::unique_lock guard(mutex);
    mutex.release();
  }
  auto shared = own.shared_mutex(name("rw"));
  {
    std::shared_lock guard(shared);
    shared.release_shared();
  }
  {
    std::lock_guard guard(shared);
    shared.release();
  }
  auto recursive = own.recursive_mutex(name("r"));
  {
    std::lock_guard guard(recursive);
    recursive.release();
  }
  // release() is unlock() that reports: at a nested level it leaves the outer one held.
  recursive.lock();
  recursive.lock();
  recursive.release();
  EXPECT_TRUE(recursive.owns_lock());
  recursive.unlock();
  EXPECT_FALSE(recursive.owns_lock());
  EXPECT_EQ(reports.size(), 0u) << "a guard's unlock after release() was reported as misuse";
  mutex.unlock();  // nothing held and no release() before it: misuse
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports.last(), ErrorCode::not_held);
  // Each was really released: another client takes them at once.
  auto other = connect();
  for (const auto& lock_name : {name("m"), name("rw"), name("r")}) {
    auto contender = other.mutex(lock_name);
    EXPECT_TRUE(contender.try_lock()) << lock_name;
    contender.unlock();
  }
}

TEST_P(Conformance, UnlockFromAThreadThatDoesNotHoldIsReported) {
  Reports reports;
  auto own = connect();
  own.set_error_handler(reports.handler());
  auto mutex = own.mutex(name("m"));
  mutex.lock();
  std::async(std::launch::async, [&] { mutex.unlock(); }).get();
  ASSERT_EQ(reports.size(), 1u);
  EXPECT_EQ(reports.last(), ErrorCode::not_held);
  // The owner still holds.
  EXPECT_TRUE(mutex.owns_lock());
  auto other = connect();
  EXPECT_FALSE(other.mutex(name("m")).try_lock());
  mutex.unlock();
  EXPECT_EQ(reports.size(), 1u);
}

TEST_P(Conformance, SetErrorHandlerReplacesTheHandler) {
  Reports first;
  Reports second;
  turnstile::ClientOptions options;
  options.error_handler = first.handler();
  auto own = connect(options);
  auto mutex = own.mutex(name("m"));
  mutex.unlock();
  own.set_error_handler(second.handler());
  mutex.unlock();
  EXPECT_EQ(first.size(), 1u);
  EXPECT_EQ(second.size(), 1u);
}

TEST_P(Conformance, DefaultErrorHandlerWritesToStderr) {
  auto own = connect();
  auto mutex = own.mutex(name("m"));
  ::testing::internal::CaptureStderr();
  mutex.unlock();
  const auto text = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(text.find(name("m")), std::string::npos) << "stderr: " << text;
}

TEST_P(Conformance, ThrowingErrorHandlerDoesNotEscapeUnlock) {
  turnstile::ClientOptions options;
  options.error_handler = [](const turnstile::Error&) { throw std::runtime_error("handler failed"); };
  auto own = connect(options);
  auto mutex = own.mutex(name("m"));
  ::testing::internal::CaptureStderr();
  EXPECT_NO_THROW(mutex.unlock());
  ::testing::internal::GetCapturedStderr();
}

TEST_P(Conformance, ReleaseWithoutHoldingThrowsNotHeld) {
  auto mutex = client().mutex(name("m"));
  auto recursive = client().recursive_mutex(name("r"));
  auto shared = client().shared_mutex(name("rw"));
  EXPECT_THROW(mutex.release(), turnstile::NotHeld);
  EXPECT_THROW(recursive.release(), turnstile::NotHeld);
  EXPECT_THROW(shared.release(), turnstile::NotHeld);
  EXPECT_THROW(shared.release_shared(), turnstile::NotHeld);
  mutex.lock();
  EXPECT_NO_THROW(mutex.release());
  EXPECT_THROW(mutex.release(), turnstile::NotHeld);
  shared.lock_shared();
  EXPECT_THROW(shared.release(), turnstile::NotHeld);  // a reader releasing the write lock
  EXPECT_NO_THROW(shared.release_shared());
  turnstile::Lease empty;
  EXPECT_THROW(empty.release(), turnstile::NotHeld);
}

TEST(ConformanceConnect, BadUrlsAreTypedErrors) {
  EXPECT_THROW(Client::connect("bogus://x"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("file://relative"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("file://relative/dir"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect(""), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("no scheme at all"), turnstile::InvalidUrl);
  EXPECT_THROW(Client::connect("://nothing"), turnstile::InvalidUrl);
  try {
    Client::connect("redis://127.0.0.1:1");
    FAIL() << "connected to redis on port 1";
  } catch (const turnstile::Error& error) {
    EXPECT_TRUE(error.code() == ErrorCode::backend_not_built || error.code() == ErrorCode::backend_unavailable)
        << "code " << static_cast<int>(error.code()) << ": " << error.what();
  }
  try {
    Client::connect("bogus://x");
  } catch (const turnstile::Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::invalid_url);
    EXPECT_NE(std::string(error.what()).find("bogus"), std::string::npos) << error.what();
  }
}

TEST(ConformanceConnect, ConnectWithoutUrlUsesTheEnvironment) {
  const char* saved = std::getenv("TURNSTILE_BACKEND");
  const std::string saved_value = saved ? saved : "";
  setenv("TURNSTILE_BACKEND", "bogus://x", 1);
  EXPECT_THROW(Client::connect(), turnstile::InvalidUrl);
  char dir[] = "/tmp/turnstile-env-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string url = std::string("file://") + dir + "/backend";
  setenv("TURNSTILE_BACKEND", url.c_str(), 1);
  {
    auto client = Client::connect();
    EXPECT_EQ(client.url(), url);
    auto mutex = client.mutex("x");
    EXPECT_TRUE(mutex.try_lock());
    mutex.unlock();
  }
  if (saved) {
    setenv("TURNSTILE_BACKEND", saved_value.c_str(), 1);
  } else {
    unsetenv("TURNSTILE_BACKEND");
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

}  // namespace conformance
