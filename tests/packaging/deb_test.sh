#!/bin/sh
# The Debian packages as a user gets them: built by CPack from this build, unpacked with
# `dpkg-deb -x` (no installation: the build tree's libraries stay out of reach), the CLI run from
# them, finding the library and its backend modules; each package says what it depends on.
#   deb_test.sh BUILD_DIR
set -eu
build=$1
work=$(mktemp -d /tmp/turnstile-deb-test-XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

(cd "$build" && cpack -B "$work/debs" >/dev/null) || fail "cpack failed"
for package in libturnstile0 libturnstile-dev turnstile; do
  deb=$(ls "$work"/debs/${package}_*.deb 2>/dev/null | head -n 1)
  [ -n "$deb" ] || fail "no $package package"
  dpkg-deb -x "$deb" "$work/root"
  echo "$package: $(dpkg-deb -f "$deb" Depends)"
done
dpkg-deb -f "$work"/debs/libturnstile0_*.deb Depends | grep -q "libhiredis" || fail "libturnstile0 does not depend on hiredis"
dpkg-deb -f "$work"/debs/libturnstile0_*.deb Depends | grep -q "libcurl" || fail "libturnstile0 does not depend on libcurl"
dpkg-deb -f "$work"/debs/libturnstile0_*.deb Depends | grep -q "libgrpc++" || fail "libturnstile0 does not depend on gRPC"
dpkg-deb -f "$work"/debs/turnstile_*.deb Depends | grep -q "libturnstile0 (= " || fail "turnstile does not depend on libturnstile0"
[ -f "$work/root/usr/include/turnstile/turnstile.hpp" ] || fail "no headers in libturnstile-dev"
[ -n "$(find "$work/root" -name turnstile.pc)" ] || fail "no turnstile.pc in libturnstile-dev"

cli="$work/root/usr/bin/turnstile"
env -u LD_LIBRARY_PATH "$cli" --version | grep -q "^turnstile " || fail "the packaged CLI does not start"
env -u LD_LIBRARY_PATH "$cli" run --backend "file://$work/state" --lock job -- true || fail "the packaged CLI cannot lock"
status=0
env -u LD_LIBRARY_PATH "$cli" run --backend consul://127.0.0.1:1 --lock job --timeout 2 -- true 2>"$work/err" || status=$?
[ "$status" -eq 69 ] || fail "consul://127.0.0.1:1: expected 69 (module found, server unreachable), got $status: $(cat "$work/err")"
echo "the .deb files unpack and run"
