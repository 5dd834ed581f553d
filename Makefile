# The two set-up commands of the README's Quick start, on a fresh Debian 12 machine:
#   make demo   installs missing Debian packages, builds, runs the parking-lot demo
#   make test   the same set-up, then every test through CTest, plain and under the sanitizers
# Other targets: build, bench, faults (the long fault suite), mutants (safety mutants planted one
# at a time: does a test catch each?), package (.deb files), test-plain, test-asan,
# test-asan-long, test-tsan, clean.

# What the build, the tests and the benchmarks need, all from Debian 12.
PACKAGES := g++ cmake make pkg-config libgtest-dev libgmock-dev libbenchmark-dev libcli11-dev \
            nlohmann-json3-dev util-linux procps hyperfine \
            libhiredis-dev redis-server redis-tools python3-redis \
            libzookeeper-mt-dev zookeeper default-jdk-headless \
            libcurator-recipes-java libcurator-framework-java libcurator-client-java \
            libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc \
            etcd-server etcd-client openssl locales \
            python3 python3-consul python3-requests libcurl4-openssl-dev libsqlite3-dev \
            dpkg-dev file iproute2
JOBS := $(shell nproc 2>/dev/null || echo 2)
CLI := build/tools/turnstile/turnstile

.PHONY: deps build demo test test-plain test-asan test-asan-long test-tsan bench faults mutants package clean

# apt-get only when something is missing; as root it installs, otherwise it prints the command.
deps:
	@missing=""; for p in $(PACKAGES); do \
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

build: deps
	cmake --preset default
	cmake --build --preset default -j $(JOBS)

demo: build
	$(CLI) demo parking

test: test-plain test-asan test-tsan

test-plain: build
	ctest --preset default -j $(JOBS)

# Every test under AddressSanitizer and UndefinedBehaviorSanitizer, but the short fault runs and
# the wake-up counts (they run in test-plain; under ASan they take some 6 minutes more, so they
# have their own target, test-asan-long, to keep make test within its budget).
test-asan: deps
	cmake --preset asan
	cmake --build --preset asan -j $(JOBS)
	ctest --preset asan -j $(JOBS)

test-asan-long: deps
	cmake --preset asan
	cmake --build --preset asan -j $(JOBS)
	ctest --preset asan-long -j $(JOBS)

# The core (unit, conformance and embedded-backend tests) under ThreadSanitizer.
test-tsan: deps
	cmake --preset tsan
	cmake --build --preset tsan -j $(JOBS)
	ctest --preset tsan -j $(JOBS)

bench: build
	bench/run.sh build

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

# Debian packages (libturnstile0, libturnstile-dev, turnstile) in build/, by CPack.
package: build
	cd build && cpack

clean:
	rm -rf build build-asan build-tsan build-mutants
