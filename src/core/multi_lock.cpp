#include "turnstile/multi_lock.hpp"

namespace turnstile {

bool MultiLock::acquire_until(Deadline deadline) {
  std::size_t taken = 0;
  const auto give_back = [&] {
    while (taken > 0) members_[--taken].unlock();
  };
  try {
    for (; taken < members_.size(); ++taken) {
      if (!members_[taken].acquire(deadline)) {
        give_back();
        return false;
      }
    }
  } catch (...) {
    give_back();
    throw;
  }
  return true;
}

void MultiLock::unlock() noexcept {
  for (std::size_t i = members_.size(); i-- > 0;) members_[i].unlock();
}

}  // namespace turnstile
