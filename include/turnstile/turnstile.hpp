// SPDX-License-Identifier: Apache-2.0
// The whole public API of turnstile.
#pragma once

#include "turnstile/async.hpp"
#include "turnstile/client.hpp"
#include "turnstile/election.hpp"
#include "turnstile/error.hpp"
#include "turnstile/lease.hpp"
#include "turnstile/lock.hpp"
#include "turnstile/metrics.hpp"
#include "turnstile/multi_lock.hpp"
#include "turnstile/permit_counter.hpp"
#include "turnstile/semaphore.hpp"
