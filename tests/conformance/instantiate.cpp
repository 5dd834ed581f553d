// SPDX-License-Identifier: Apache-2.0
// The one place the suite meets its backends: every TEST_P of Conformance runs once per URL.
#include "conformance/support.hpp"

namespace conformance {

INSTANTIATE_TEST_SUITE_P(Backends, Conformance, ::testing::ValuesIn(backend_params()), param_label);

}  // namespace conformance
