// SPDX-License-Identifier: Apache-2.0
#include "testing/hold_history.hpp"

#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <tuple>
#include <utility>

#include "core/text_escape.hpp"

namespace turnstile::testing {

std::int64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return std::int64_t{ts.tv_sec} * 1'000'000'000 + ts.tv_nsec;
}

// ---------------------------------------------------------------------------------------------
// Recorders

void HoldRecorder::record(HoldRecord record) {
  std::lock_guard lock(mutex_);
  records_.push_back(std::move(record));
}

std::vector<HoldRecord> HoldRecorder::records() const {
  std::lock_guard lock(mutex_);
  return records_;
}

std::size_t HoldRecorder::size() const {
  std::lock_guard lock(mutex_);
  return records_.size();
}

void HoldRecorder::clear() {
  std::lock_guard lock(mutex_);
  records_.clear();
}

FileHoldRecorder::FileHoldRecorder(std::string path) : path_(std::move(path)) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
  if (fd_ < 0) throw std::system_error(errno, std::generic_category(), "open " + path_);
}

FileHoldRecorder::~FileHoldRecorder() {
  if (fd_ >= 0) ::close(fd_);
}

void FileHoldRecorder::record(const HoldRecord& record) {
  const std::string line = format_line(record);
  for (;;) {
    const ssize_t written = ::write(fd_, line.data(), line.size());
    if (written < 0 && errno == EINTR) continue;
    if (written < 0) throw std::system_error(errno, std::generic_category(), "write " + path_);
    if (static_cast<std::size_t>(written) != line.size()) {
      throw std::system_error(EIO, std::generic_category(), "short write to " + path_);
    }
    return;
  }
}

// ---------------------------------------------------------------------------------------------
// File format: one record per line, tab-separated:
//   h1 <kind> <permits> <token> <start_ns> <end_ns> <request_ns> <name, percent-encoded>
// The name encoding escapes '%', whitespace and control bytes, so any name fits on one line.

namespace {

constexpr std::string_view kLineTag = "h1";

// '%', whitespace and control bytes are escaped, so any name fits in one field of one line.
bool kept_in_a_field(unsigned char c) { return c > 0x20 && c != 0x7F && c != '%'; }

std::string encode_name(const std::string& name) { return turnstile::detail::percent_encode(name, kept_in_a_field); }

std::string decode_name(std::string_view text) {
  auto name = turnstile::detail::percent_decode(text);
  if (!name) throw std::invalid_argument("bad %-escape in name");
  return std::move(*name);
}

template <class Int>
Int parse_int(std::string_view text, const char* what) {
  Int value{};
  const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (error != std::errc() || end != text.data() + text.size() || text.empty()) {
    throw std::invalid_argument(std::string("bad ") + what + " '" + std::string(text) + "'");
  }
  return value;
}

}  // namespace

std::string format_line(const HoldRecord& record) {
  std::string line;
  line.reserve(64 + record.name.size() * 3);
  line += kLineTag;
  line += '\t';
  line += record.kind.empty() ? std::string("-") : encode_name(record.kind);
  line += '\t';
  line += std::to_string(record.permits);
  line += '\t';
  line += std::to_string(record.token);
  line += '\t';
  line += std::to_string(record.start_ns);
  line += '\t';
  line += std::to_string(record.end_ns);
  line += '\t';
  line += std::to_string(record.request_ns);
  line += '\t';
  line += encode_name(record.name);
  line += '\n';
  return line;
}

HoldRecord parse_line(std::string_view line) {
  if (!line.empty() && line.back() == '\n') line.remove_suffix(1);
  std::vector<std::string_view> fields;
  std::size_t start = 0;
  for (;;) {
    const auto tab = line.find('\t', start);
    fields.push_back(line.substr(start, tab == std::string_view::npos ? std::string_view::npos : tab - start));
    if (tab == std::string_view::npos) break;
    start = tab + 1;
  }
  if (fields.size() != 8 || fields[0] != kLineTag) {
    throw std::invalid_argument("not a hold record line: '" + std::string(line) + "'");
  }
  HoldRecord record;
  record.kind = fields[1] == "-" ? std::string() : decode_name(fields[1]);
  record.permits = parse_int<std::int64_t>(fields[2], "permits");
  record.token = parse_int<std::uint64_t>(fields[3], "token");
  record.start_ns = parse_int<std::int64_t>(fields[4], "start");
  record.end_ns = parse_int<std::int64_t>(fields[5], "end");
  record.request_ns = parse_int<std::int64_t>(fields[6], "request");
  record.name = decode_name(fields[7]);
  return record;
}

std::vector<HoldRecord> load_history(const std::string& path) {
  std::vector<HoldRecord> records;
  std::ifstream in(path, std::ios::binary);
  if (!in) return records;
  std::string line;
  std::size_t number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.empty()) continue;
    try {
      records.push_back(parse_line(line));
    } catch (const std::invalid_argument& error) {
      throw std::invalid_argument(path + ":" + std::to_string(number) + ": " + error.what());
    }
  }
  return records;
}

// ---------------------------------------------------------------------------------------------
// The checker

namespace {

constexpr std::size_t kMaxReportsPerRule = 20;

bool known_kind(const std::string& kind) { return kind == "exclusive" || kind == "shared" || kind == "lease"; }

std::string show(const HoldRecord& r) {
  std::ostringstream out;
  out << r.kind << " hold (token " << r.token;
  if (r.kind == "lease") out << ", " << r.permits << " permit" << (r.permits == 1 ? "" : "s");
  out << ", [" << r.start_ns << ", " << r.end_ns << "] ns)";
  return out.str();
}

bool overlap(const HoldRecord& a, const HoldRecord& b) { return a.start_ns < b.end_ns && b.start_ns < a.end_ns; }

// A writer that took the read lock and then dropped the write lock: one queue entry, recorded
// as an exclusive record and a shared one with the same token, the read taken while writing.
bool is_downgrade(const HoldRecord& a, const HoldRecord& b) {
  if (a.token != b.token) return false;
  const HoldRecord* writer = nullptr;
  const HoldRecord* reader = nullptr;
  if (a.kind == "exclusive" && b.kind == "shared") {
    writer = &a;
    reader = &b;
  } else if (a.kind == "shared" && b.kind == "exclusive") {
    writer = &b;
    reader = &a;
  } else {
    return false;
  }
  return writer->start_ns <= reader->start_ns && reader->start_ns <= writer->end_ns;
}

// Where an event sorts among the events of the same instant t: holds that end at t leave
// first (touching is not overlap), then a hold of zero length at t comes and goes (it overlaps
// exactly the holds that strictly contain t), then holds that start at t arrive.
int event_order(const HoldRecord& r, bool start) {
  if (r.start_ns == r.end_ns) return start ? 1 : 2;
  return start ? 3 : 0;
}

// Collects the reports of one rule, keeping the first kMaxReportsPerRule.
class Rule {
 public:
  Rule(std::vector<std::string>& out, std::string name, const char* what)
      : out_(out), name_(std::move(name)), what_(what) {}
  ~Rule() {
    if (count_ > kMaxReportsPerRule) {
      out_.push_back("'" + name_ + "': ... and " + std::to_string(count_ - kMaxReportsPerRule) + " more " + what_ +
                     " violations");
    }
  }
  void report(const std::string& text) {
    if (++count_ <= kMaxReportsPerRule) out_.push_back("'" + name_ + "': " + text);
  }

 private:
  std::vector<std::string>& out_;
  std::string name_;
  const char* what_;
  std::size_t count_ = 0;
};

// 1. Malformed records are reported and left out of the other rules; the rest, sorted by start.
std::vector<HoldRecord> well_formed(const std::string& name, std::vector<HoldRecord> all,
                                    std::vector<std::string>& out) {
  std::vector<HoldRecord> records;
  {
    Rule rule(out, name, "malformed-record");
    for (auto& r : all) {
      if (!known_kind(r.kind)) {
        rule.report("unknown kind '" + r.kind + "' in record with token " + std::to_string(r.token));
      } else if (r.end_ns < r.start_ns) {
        rule.report(show(r) + " ends before it starts");
      } else if (r.permits <= 0) {
        rule.report(show(r) + " has " + std::to_string(r.permits) + " permits");
      } else if (r.request_ns != 0 && r.request_ns > r.start_ns) {
        rule.report(show(r) + " was requested at " + std::to_string(r.request_ns) + " ns, after it started");
      } else if (r.kind != "lease" && r.permits != 1) {
        rule.report(show(r) + " is a lock hold with " + std::to_string(r.permits) + " permits");
      } else {
        records.push_back(std::move(r));
      }
    }
  }
  std::sort(records.begin(), records.end(), [](const HoldRecord& a, const HoldRecord& b) {
    return std::tie(a.start_ns, a.end_ns, a.token) < std::tie(b.start_ns, b.end_ns, b.token);
  });
  return records;
}

// 2. Exclusion: sweep in start order, comparing each hold with those still active.
void check_exclusion(const std::string& name, const std::vector<HoldRecord>& records, std::vector<std::string>& out) {
  Rule both(out, name, "exclusive-overlap");
  Rule writer(out, name, "writer-overlap");
  std::vector<const HoldRecord*> active;
  for (const auto& r : records) {
    std::erase_if(active, [&](const HoldRecord* a) { return a->end_ns <= r.start_ns; });
    for (const HoldRecord* a : active) {
      if (!overlap(*a, r)) continue;
      if (a->kind != "exclusive" && r.kind != "exclusive") continue;
      if (is_downgrade(*a, r)) continue;
      const auto by = std::min(a->end_ns, r.end_ns) - std::max(a->start_ns, r.start_ns);
      const std::string text = show(*a) + " overlaps " + show(r) + " by " + std::to_string(by) + " ns";
      if (a->kind == "exclusive" && r.kind == "exclusive") {
        both.report("two exclusive holds overlap: " + text);
      } else {
        writer.report("a writer overlaps another holder: " + text);
      }
    }
    active.push_back(&r);
  }
}

// A lease hold's start or end, for the limit sweep.
struct LeaseEvent {
  std::int64_t at;
  int order;  // see event_order()
  const HoldRecord* record;
};

// The starts and ends of the lease holds, in the order the limit sweep takes them.
std::vector<LeaseEvent> lease_events(const std::vector<HoldRecord>& records) {
  std::vector<LeaseEvent> events;
  for (const auto& r : records) {
    if (r.kind != "lease") continue;
    events.push_back({r.start_ns, event_order(r, true), &r});
    events.push_back({r.end_ns, event_order(r, false), &r});
  }
  std::sort(events.begin(), events.end(),
            [](const LeaseEvent& a, const LeaseEvent& b) { return std::tie(a.at, a.order) < std::tie(b.at, b.order); });
  return events;
}

// 3. The Semaphore's limit over lease permits.
void check_limit(const std::string& name, const std::vector<HoldRecord>& records, std::int64_t limit,
                 std::vector<std::string>& out) {
  Rule rule(out, name, "limit");
  const auto events = lease_events(records);
  std::int64_t held = 0;
  bool over = false;
  std::vector<const HoldRecord*> active;
  for (const auto& e : events) {
    if (e.order == 0 || e.order == 2) {
      held -= e.record->permits;
      std::erase(active, e.record);
      if (held <= limit) over = false;
      continue;
    }
    held += e.record->permits;
    active.push_back(e.record);
    if (held > limit && !over) {
      over = true;
      std::string holders;
      for (const HoldRecord* a : active) {
        holders += holders.empty() ? "" : ", ";
        holders += "token " + std::to_string(a->token) + " x" + std::to_string(a->permits);
      }
      rule.report(std::to_string(held) + " lease permits held at once at " + std::to_string(e.at) +
                  " ns, the limit is " + std::to_string(limit) + " (" + holders + ")");
    }
  }
}

// 4a. Fencing among exclusive holds: unique, increasing with start time.
void check_exclusive_tokens(const std::string& name, const std::vector<HoldRecord>& records,
                            std::vector<std::string>& out) {
  Rule rule(out, name, "exclusive-token");
  const HoldRecord* previous = nullptr;
  std::map<std::uint64_t, const HoldRecord*> seen;
  for (const auto& r : records) {
    if (r.kind != "exclusive") continue;
    if (auto [it, fresh] = seen.emplace(r.token, &r); !fresh) {
      rule.report("fencing token " + std::to_string(r.token) + " given to two exclusive holds: " + show(*it->second) +
                  " and " + show(r));
    } else if (previous && r.token <= previous->token) {
      rule.report("fencing token does not increase: " + show(r) + " started after " + show(*previous));
    }
    previous = &r;
  }
}

// Records sorted by end, with the running maximum of their tokens: "the greatest token of
// the holds that ended before t" is then one binary search.
struct Ended {
  std::vector<const HoldRecord*> by_end;
  std::vector<const HoldRecord*> max_so_far;
  void build() {
    std::sort(by_end.begin(), by_end.end(),
              [](const HoldRecord* a, const HoldRecord* b) { return a->end_ns < b->end_ns; });
    max_so_far.resize(by_end.size());
    for (std::size_t i = 0; i < by_end.size(); ++i) {
      max_so_far[i] = (i == 0 || by_end[i]->token > max_so_far[i - 1]->token) ? by_end[i] : max_so_far[i - 1];
    }
  }
  const HoldRecord* greatest_before(std::int64_t t) const {
    const auto ended = std::lower_bound(by_end.begin(), by_end.end(), t,
                                        [](const HoldRecord* a, std::int64_t at) { return a->end_ns < at; }) -
                       by_end.begin();
    return ended == 0 ? nullptr : max_so_far[static_cast<std::size_t>(ended) - 1];
  }
};

// 4b. Fencing across holds: a hold that provably joined the queue after another one left
// carries a greater token. With an exclusive hold on either side, starting after the other's
// end proves it; between shared/lease holds only the request time does (see the header).
void check_token_order(const std::string& name, const std::vector<HoldRecord>& records, std::vector<std::string>& out) {
  Rule rule(out, name, "token-order");
  Ended all;
  Ended exclusive;
  for (const auto& r : records) {
    all.by_end.push_back(&r);
    if (r.kind == "exclusive") exclusive.by_end.push_back(&r);
  }
  all.build();
  exclusive.build();
  for (const auto& r : records) {
    const HoldRecord* before = nullptr;
    const char* how = " started after ";
    if (r.kind == "exclusive") {
      before = all.greatest_before(r.start_ns);
    } else {
      before = exclusive.greatest_before(r.start_ns);
      if (r.request_ns != 0) {
        const HoldRecord* asked = all.greatest_before(r.request_ns);
        if (asked && (!before || asked->token > before->token)) {
          before = asked;
          how = " was requested after ";
        }
      }
    }
    if (before && before->token >= r.token) {
      rule.report("fencing token does not increase: " + show(r) + how + show(*before) + " ended");
    }
  }
}

void check_name(const std::string& name, std::vector<HoldRecord> all, std::int64_t limit,
                std::vector<std::string>& out) {
  const auto records = well_formed(name, std::move(all), out);
  check_exclusion(name, records, out);
  if (limit > 0) check_limit(name, records, limit, out);
  check_exclusive_tokens(name, records, out);
  check_token_order(name, records, out);
}

}  // namespace

std::vector<std::string> check(const std::vector<HoldRecord>& records, const LimitForName& limit_for_name) {
  std::map<std::string, std::vector<HoldRecord>> by_name;
  for (const auto& r : records) by_name[r.name].push_back(r);
  std::vector<std::string> violations;
  for (auto& [name, group] : by_name) {
    const std::int64_t limit = limit_for_name ? limit_for_name(name) : 0;
    check_name(name, std::move(group), limit, violations);
  }
  return violations;
}

std::vector<std::string> check(const std::vector<HoldRecord>& records, std::int64_t limit) {
  return check(records, [limit](const std::string&) { return limit; });
}

namespace {

std::int64_t peak(const std::vector<const HoldRecord*>& records) {
  std::vector<std::tuple<std::int64_t, int, std::int64_t>> events;  // (time, order, delta)
  for (const HoldRecord* r : records) {
    if (r->end_ns < r->start_ns) continue;  // malformed
    const std::int64_t weight = r->kind == "lease" ? r->permits : 1;
    events.emplace_back(r->start_ns, event_order(*r, true), weight);
    events.emplace_back(r->end_ns, event_order(*r, false), -weight);
  }
  std::sort(events.begin(), events.end());
  std::int64_t current = 0;
  std::int64_t best = 0;
  for (const auto& [at, order, delta] : events) {
    current += delta;
    best = std::max(best, current);
  }
  return best;
}

}  // namespace

std::int64_t max_concurrency(const std::vector<HoldRecord>& records) {
  std::vector<const HoldRecord*> all;
  for (const auto& r : records) all.push_back(&r);
  return peak(all);
}

std::int64_t max_concurrency(const std::vector<HoldRecord>& records, const std::string& name) {
  std::vector<const HoldRecord*> some;
  for (const auto& r : records) {
    if (r.name == name) some.push_back(&r);
  }
  return peak(some);
}

std::string describe(const std::vector<std::string>& violations) {
  std::string text;
  for (const auto& v : violations) text += v + "\n";
  return text;
}

}  // namespace turnstile::testing
