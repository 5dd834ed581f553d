# SPDX-License-Identifier: Apache-2.0
# The two set-up commands of the README's Quick start, on a fresh Debian 12 machine:
#   make demo   installs missing Debian packages, builds, runs the parking-lot demo
#   make test   the same set-up, then every test through CTest, plain and under the sanitizers
# Other targets: build, bench, faults (the long fault suite), mutants (safety mutants planted one
# at a time: does a test catch each?), package (.deb files), check (format and warnings),
# test-plain, test-asan, test-asan-long, test-tsan, clean.

# What the build, the tests and the benchmarks need, all from Debian 12.
PACKAGES := g++ cmake make pkg-config libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev \
            nlohmann-json3-dev util-linux procps hyperfine \
            libhiredis-dev redis-server redis-tools python3-redis \
            libzookeeper-mt-dev zookeeper default-jdk-headless \
            libcurator-recipes-java libcurator-framework-java libcurator-client-java \
            libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc \
            etcd-server etcd-client openssl locales \
            python3 python3-consul python3-requests python3-prometheus-client libcurl4-openssl-dev libsqlite3-dev \
            dpkg-dev file iproute2 clang-format \
            libcpp-httplib-dev chromium
# The benchmarks' peers and plots (make bench): Go's etcd client (built offline from Debian's
# sources), kazoo, matplotlib.
BENCH_PACKAGES := golang-go golang-etcd-server-dev python3-kazoo python3-matplotlib hyperfine
BENCH_TARGETS := turnstile_cli turnstile_bench_uncontended turnstile_bench_contention turnstile_bench_growth \
                 turnstile_bench_async \
                 turnstile_bench_redis_uncontended turnstile_bench_zookeeper turnstile_bench_etcd \
                 turnstile_bench_etcd_raw turnstile_bench_consul \
                 turnstile-redis turnstile-zookeeper turnstile-etcd turnstile-consul
JOBS := $(shell nproc 2>/dev/null || echo 2)
# Tests mostly wait (on servers, timers, child processes), so CTest runs four per core; three
# under ASan and two under TSan, whose tests spend 2 and 5-15 times the processor time. Tests
# that cannot share a server have one of their own (the wake-up counts, the fault runs) or a
# RESOURCE_LOCK (a cluster's fail-over tests, the two packaging tests).
TEST_JOBS := $(shell echo $$(( $(JOBS) * 4 )))
ASAN_TEST_JOBS := $(shell echo $$(( $(JOBS) * 3 )))
TSAN_TEST_JOBS := $(shell echo $$(( $(JOBS) * 2 )))
CLI := build/tools/turnstile/turnstile
# Under the sanitizers a failed test runs once more (the plain tree never retries): what they
# look for, a memory or thread error, fails both runs when it is there, while their own
# intermittent faults do not (LeakSanitizer's tracer crashing at a test's exit while threads end,
# seen once) nor do the doubled timings. Both runs of a retried test are in its tree's
# Testing/Temporary/LastTest.log; docs/testing.md says so.
SANITIZER_RETRY := --repeat until-pass:2

.PHONY: deps build demo check check-format check-warnings test test-plain test-asan test-asan-long test-tsan \
        bench faults mutants package clean pipeline-plain-build pipeline-plain-tests pipeline-asan-build \
        pipeline-asan-tests pipeline-tsan-build pipeline-tsan-tests

# apt-get only when something is missing; as root it installs, otherwise it prints the command.
define install_missing
	@missing=""; for p in $(1); do \
	  dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" -eq 0 ]; then \
	  echo "installing:$$missing"; \
	  apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing; \
	else \
	  echo "missing Debian packages; run:"; \
	  echo "  sudo apt-get update && sudo apt-get install -y$$missing"; \
	  exit 1; \
	fi
endef

deps:
	$(call install_missing,$(PACKAGES))

build: deps
	cmake --preset default
	cmake --build --preset default -j $(JOBS)

demo: build
	$(CLI) demo parking

# The checks that fail in seconds, before anything is built: the format of every C++ file
# (.clang-format) and src/ and tools/ compiled with -Wall -Wextra -Wshadow -Werror (the default
# tree, which the plain build then completes).
check: check-format check-warnings

check-format: deps
	tests/check_format.sh

check-warnings: deps check-format
	cmake --preset default
	cmake --build --preset warnings -j $(JOBS)

# make test: the checks, then three trees, plain, ASan+UBSan and TSan, built and tested in a
# pipeline: while one tree's tests run (they mostly wait), the next tree builds at low priority
# (nice 19), so the tests keep the processors whenever they need them. At most one build and one
# test run at a time: plain build, then plain tests beside the ASan build, then ASan tests beside
# the TSan build, then TSan tests.
test: deps
	$(MAKE) --no-print-directory -j 2 --output-sync=line pipeline-tsan-tests

pipeline-plain-build: check-warnings
	cmake --build --preset default -j $(JOBS)

pipeline-plain-tests: pipeline-plain-build
	ctest --preset default -j $(TEST_JOBS)

pipeline-asan-build: pipeline-plain-build
	cmake --preset asan
	nice -n 19 cmake --build --preset asan -j $(JOBS)

pipeline-asan-tests: pipeline-asan-build pipeline-plain-tests
	ctest --preset asan -j $(ASAN_TEST_JOBS) $(SANITIZER_RETRY)

pipeline-tsan-build: pipeline-asan-build
	cmake --preset tsan
	nice -n 19 cmake --build --preset tsan -j $(JOBS)

pipeline-tsan-tests: pipeline-tsan-build pipeline-asan-tests
	ctest --preset tsan -j $(TSAN_TEST_JOBS) $(SANITIZER_RETRY)

# One tree at a time (make test runs the same steps, overlapped).
test-plain: build
	ctest --preset default -j $(TEST_JOBS)

# Every test under AddressSanitizer and UndefinedBehaviorSanitizer, but the examples (they run in
# test-plain), the short fault runs and the wake-up counts (they run in test-plain; under ASan
# they take some 6 minutes more, so they have their own target, test-asan-long).
test-asan: deps
	cmake --preset asan
	cmake --build --preset asan -j $(JOBS)
	ctest --preset asan -j $(ASAN_TEST_JOBS) $(SANITIZER_RETRY)

test-asan-long: deps
	cmake --preset asan-long
	cmake --build --preset asan-long -j $(JOBS)
	ctest --preset asan-long -j $(ASAN_TEST_JOBS) $(SANITIZER_RETRY)

# Under ThreadSanitizer: the unit tests, the embedded backend's, and the conformance suite on
# every backend (the tsan tree builds nothing else).
test-tsan: deps
	cmake --preset tsan
	cmake --build --preset tsan -j $(JOBS)
	ctest --preset tsan -j $(TSAN_TEST_JOBS) $(SANITIZER_RETRY)

# Every backend against its peers and limits in one run (bench/all.py): writes the generated part
# of docs/benchmarks.md, the summary table of README.md and docs/bench/*.png. Builds only what it
# runs. About 10 minutes on 2 cores; bench/run.sh BUILDDIR [--redis] is the older file:// and
# redis:// comparison alone.
bench: deps
	$(call install_missing,$(BENCH_PACKAGES))
	cmake --preset default
	cmake --build --preset default -j $(JOBS) --target $(BENCH_TARGETS)
	/usr/bin/python3 bench/all.py build

# The full fault suite: every backend under server and client faults, at least 10,000 holds
# each, one table (build/faults/table.md). `make test` runs a short version (CTest label faults).
faults: build
	tests/faults/run_all.sh build

# The safety mutants of tests/mutants/mutants.ini, each planted alone in the source tree (restored
# right after, and on SIGINT/SIGTERM/SIGHUP), built incrementally in build-mutants, with the tests
# that should catch it; prints caught/missed and the score. Not part of make test (it runs the
# listed suites once per mutant). MUTANTS_ONLY=REGEX picks mutants by id or backend.
mutants: deps
	python3 tests/mutants/run.py --jobs $(JOBS)

# Debian packages (libturnstile0, libturnstile-{redis,zookeeper,etcd,consul}0, libturnstile-dev,
# turnstile) in build/, by CPack.
package: build
	cd build && cpack

clean:
	rm -rf build build-asan build-tsan build-mutants
