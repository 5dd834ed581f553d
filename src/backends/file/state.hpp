// The layout of a file:// state file (n.<name>.s), shared by every process that maps it.
// Kept in a header of its own so tests can build the states a crash could leave behind.
#pragma once

#include <pthread.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>

namespace turnstile::detail::file_state {

constexpr std::uint32_t kMagic = 0x54534C31;  // "TSL1"
// 2: no wake-up FIFOs (a futex word for PermitCounter waiters), crash-safe entry removal.
// 3: holder labels (ClientOptions::holder_label), in a table the slots point into.
constexpr std::uint32_t kVersion = 3;
constexpr std::size_t kCapacity = 1024;
constexpr std::size_t kMaxName = 256;
constexpr std::size_t kMaxLabel = 256;      // ClientOptions::holder_label's limit
constexpr std::uint8_t kCounterWaiter = 9;  // a slot of the PermitCounter's own line

// Each entry owns OFD locks on bytes far beyond the end of the file, at 2^40 + 4·seq + byte.
constexpr off_t kByteBase = off_t{1} << 40;
enum class Byte : off_t { life = 0, exclusive = 1, waiting = 2 };
inline off_t byte_offset(std::uint64_t seq, Byte which) {
  return kByteBase + static_cast<off_t>(seq) * 4 + static_cast<off_t>(which);
}

enum class Mode : std::uint32_t { none = 0, lock = 1, semaphore = 2 };

// seq 0 marks a slot being rewritten: an entry is complete exactly when its seq is not 0
// (removal writes seq last), so a process killed mid-copy leaves a slot repair can recognise.
struct Slot {
  std::uint64_t seq;
  std::int64_t permits;
  std::int64_t since_ns;  // CLOCK_REALTIME, for inspect
  std::int32_t pid;       // for inspect only: never used to decide liveness
  std::uint8_t kind;      // EntryKind or kCounterWaiter
  std::uint8_t reserved;
  std::uint16_t label;  // 1 + its index in Header::labels, 0 for none (for inspect only)
};
static_assert(sizeof(Slot) == 32);

// A holder label, NUL-terminated. Written before the slot that points to it is appended, and
// free again once no slot points to it: a crash in between leaves nothing to repair.
struct Label {
  char text[kMaxLabel + 1];
};

struct Header {
  std::uint32_t magic;
  std::uint32_t version;
  char boot_id[40];  // a file from an earlier boot may hold a mutex owned by a dead thread
  pthread_mutex_t mutex;
  std::uint64_t next_seq;  // the last fencing token handed out
  std::int64_t limit;
  Mode mode;
  std::uint32_t counter_epoch;     // futex word: bumped whenever PermitCounter permits appear
  std::uint32_t counter_sleepers;  // head counter waiters sleeping on counter_epoch
  std::uint32_t counter_set;
  std::int64_t counter;
  std::uint32_t name_length;
  char name[kMaxName];
  std::uint32_t count;
  Slot slots[kCapacity];  // the queue, in arrival order: slots[0..count)
  Label labels[kCapacity];
};

}  // namespace turnstile::detail::file_state
