// SPDX-License-Identifier: Apache-2.0
// The layout of a file:// state file (n.<name>.s), shared by every process that maps it.
// Kept in a header of its own so tests can build the states a crash could leave behind.
#pragma once

#include <pthread.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>

namespace turnstile::detail::file_state {

// Versions 1 to 5 began with "TSL1"; from version 6 (a queue that grows) files begin with "TSL2",
// so that a binary of version 5 or older refuses them whatever their size (it refuses any file
// without its magic), and never takes one for a truncated file of its own.
constexpr std::uint32_t kOldMagic = 0x54534C31;  // "TSL1"
constexpr std::uint32_t kMagic = 0x54534C32;     // "TSL2"
// 2: no wake-up FIFOs (a futex word for PermitCounter waiters), crash-safe entry removal.
// 3: holder labels (ClientOptions::holder_label), in a table the slots point into.
// 4: kept entries (release_after, --hold-at-least): Slot::kept_until_ns.
// 5: Header::removed, the mark of a file removed as unused.
// 6: the queue grows beyond 1024 entries (Header::capacity, slots after the header); a label
//    place is shared by every slot with that label.
constexpr std::uint32_t kVersion = 6;
// The slots a new file has room for; a full queue doubles them, up to kMaxCapacity. Every
// capacity is a multiple of kFirstCapacity, so the slot area always ends on a page boundary.
constexpr std::size_t kFirstCapacity = 1024;
constexpr std::size_t kMaxCapacity = std::size_t{1} << 16;
// Distinct labels in use at once in one name (each client has one): an entry whose label finds
// no place is listed without it (labels are for inspect only).
constexpr std::size_t kLabelPlaces = 1024;
constexpr std::size_t kMaxName = 256;
constexpr std::size_t kMaxLabel = 256;      // ClientOptions::holder_label's limit
constexpr std::uint8_t kCounterWaiter = 9;  // a slot of the PermitCounter's own line

// Each entry owns OFD locks on bytes far beyond the end of the file, at 2^40 + 4·seq + byte.
constexpr off_t kByteBase = off_t{1} << 40;
enum class Byte : off_t { life = 0, exclusive = 1, waiting = 2 };
inline off_t byte_offset(std::uint64_t seq, Byte which) {
  return kByteBase + static_cast<off_t>(seq) * 4 + static_cast<off_t>(which);
}

// election: the queue's entries are an election's candidates (each with a value file).
enum class Mode : std::uint32_t { none = 0, lock = 1, semaphore = 2, election = 3 };

// Slot::flags: the entry has a value file, <state file's base>.v.<seq> (an election's
// candidate). The file is renamed into place before the slot is appended, and removed after
// the slot: a crash in between leaves a value file no slot refers to (`turnstile gc` removes
// it), never a slot without its value.
constexpr std::uint8_t kHasValue = 1;

// seq 0 marks a slot being rewritten: an entry is complete exactly when its seq is not 0
// (removal writes seq last), so a process killed mid-copy leaves a slot repair can recognise.
struct Slot {
  std::uint64_t seq;
  std::int64_t permits;
  std::int64_t since_ns;  // CLOCK_REALTIME, for inspect
  std::int32_t pid;       // for inspect only: never used to decide liveness
  std::uint8_t kind;      // EntryKind or kCounterWaiter
  std::uint8_t flags;     // kHasValue
  std::uint16_t label;    // 1 + its place in Header::labels, 0 for none (for inspect only)
  // An entry released with release_after holds on without its process until then
  // (CLOCK_BOOTTIME, which every process of this boot shares; 0: not kept). Its lock bytes are
  // free, so this is the one place liveness comes from a clock.
  std::int64_t kept_until_ns;
};
static_assert(sizeof(Slot) == 40);

// A holder label, NUL-terminated. Written before the slot that points to it is appended, and
// free again once no slot points to it: a crash in between leaves nothing to repair. Slots with
// the same label point to the same place.
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
  // Set, under the mutex, by the process that removes the file as unused (before the mutex is
  // let go): whoever takes the mutex after that sees it and joins the file now at the path.
  std::uint32_t removed;
  std::uint32_t reserved;
  std::int64_t counter;
  std::uint32_t name_length;
  char name[kMaxName];
  std::uint32_t count;  // the queue, in arrival order: the first `count` slots
  // The slots the file has room for (file_size(capacity) bytes at least). Grown under the mutex:
  // the file is extended first, then this is written, so it never names room the file lacks.
  // Every process maps up to it before touching a slot (StateFile::fit_mapping). Never shrinks.
  std::uint32_t capacity;
  // Slots whose pages may have storage (the most `count` reached since the last give-back): when
  // the queue shrinks below a quarter of it, the pages beyond are given back to the file system.
  std::uint32_t slots_backed;
  std::uint32_t label_places;  // label places ever written: where a search for a label ends
  Label labels[kLabelPlaces];
};

// The slots follow the header, from a page boundary (so that growing maps whole pages).
constexpr std::size_t kPage = 4096;
constexpr std::size_t kSlotsOffset = (sizeof(Header) + kPage - 1) / kPage * kPage;
constexpr std::size_t file_size(std::size_t capacity) { return kSlotsOffset + capacity * sizeof(Slot); }
static_assert(file_size(kFirstCapacity) % kPage == 0);
inline Slot* slots_of(Header* header) {
  return reinterpret_cast<Slot*>(reinterpret_cast<char*>(header) + kSlotsOffset);
}

// What every version's file starts with (versions 1 to 5 too): the magic and version, the boot,
// the mutex and the fencing counter, which a file from an earlier boot hands on.
static_assert(offsetof(Header, version) == 4 && offsetof(Header, boot_id) == 8 && offsetof(Header, mutex) == 48 &&
              offsetof(Header, next_seq) == 48 + sizeof(pthread_mutex_t));

}  // namespace turnstile::detail::file_state
