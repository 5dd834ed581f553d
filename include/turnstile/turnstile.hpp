// The whole public API of turnstile.
#pragma once

#include "turnstile/client.hpp"
#include "turnstile/error.hpp"
#include "turnstile/lock.hpp"
#include "turnstile/multi_lock.hpp"
#include "turnstile/permit_counter.hpp"
#include "turnstile/semaphore.hpp"
