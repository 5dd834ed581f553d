#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# The Debian packages as a user gets them: built by CPack from this build, then
#  * each package's dependencies (dpkg-deb -f): libturnstile0 and turnstile pull no network
#    client library (hiredis, libzookeeper, gRPC, protobuf, abseil, libcurl); each network
#    backend module is a package of its own that does, and the command recommends them (etcd's,
#    with gRPC, it only suggests);
#  * their file lists: libraries in the multiarch directory, the modules in its turnstile/, the
#    man page gzipped -9n, /usr/share/doc/<package>/copyright (DEP-5, Apache-2.0) and
#    changelog.Debian.gz in every one,
#    the tmpfiles.d line of the host-wide directory and the postinst that makes its group;
#  * unpacked with `dpkg-deb -x` (no installation: the build tree's libraries stay out of reach),
#    the CLI runs from them, with only libturnstile0 + turnstile (file://; a network scheme says
#    which package it needs) and with every package (the modules found);
#  * the postinst and postrm, run in a mount namespace of their own (a copy of /etc, a tmpfs over
#    /run/lock, when run as root): the group and the directory are made, twice is harmless.
#   deb_test.sh BUILD_DIR
set -eu
build=$1
work=$(mktemp -d /tmp/turnstile-deb-test-XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
multiarch=$(dpkg-architecture -qDEB_HOST_MULTIARCH)
heavy='libhiredis|libzookeeper|libgrpc|libprotobuf|libabsl|libcurl'

(cd "$build" && cpack -B "$work/debs" >/dev/null) || fail "cpack failed"
deb_of() { ls "$work"/debs/"$1"_*.deb 2>/dev/null | head -n 1; }
families=""
for family in redis zookeeper etcd consul; do
  [ ! -f "$build/src/libturnstile-$family.so" ] || families="$families $family"
done
packages="libturnstile0 libturnstile-dev turnstile"
for family in $families; do packages="$packages libturnstile-${family}0"; done

for package in $packages; do
  deb=$(deb_of "$package")
  [ -n "$deb" ] || fail "no $package package"
  echo "$package: Depends: $(dpkg-deb -f "$deb" Depends)"
  dpkg-deb -c "$deb" | awk '{print $NF}' >"$work/$package.files"
  dpkg-deb -x "$deb" "$work/all"
  copyright="$work/all/usr/share/doc/$package/copyright"
  [ -f "$copyright" ] || fail "$package has no /usr/share/doc/$package/copyright"
  grep -q "^Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/" "$copyright" ||
    fail "$package's copyright is not machine-readable (DEP-5)"
  grep -q "^License: Apache-2.0" "$copyright" || fail "$package's copyright names no Apache-2.0 license"
  zcat "$work/all/usr/share/doc/$package/changelog.Debian.gz" | head -n 1 | grep -q "^turnstile ([0-9.]*) " ||
    fail "$package has no /usr/share/doc/$package/changelog.Debian.gz"
  ! grep -E "^\./usr/lib/[^/]*\.so|^\./usr/lib/turnstile/" "$work/$package.files" ||
    fail "$package has libraries outside the multiarch directory /usr/lib/$multiarch"
done

# The embedded backend alone pulls nothing of the network backends.
for package in libturnstile0 turnstile; do
  ! dpkg-deb -f "$(deb_of $package)" Depends | grep -Eq "$heavy" || fail "$package depends on a network client library"
done
grep -q "^\./usr/lib/$multiarch/libturnstile\.so\.0" "$work/libturnstile0.files" || fail "libturnstile0: no libturnstile.so.0 in /usr/lib/$multiarch"
! grep -q "/turnstile/libturnstile-" "$work/libturnstile0.files" || fail "libturnstile0 ships a network backend module"
dpkg-deb -f "$(deb_of turnstile)" Depends | grep -q "libturnstile0 (= " || fail "turnstile does not depend on libturnstile0"
dpkg-deb -f "$(deb_of libturnstile-dev)" Depends | grep -q "libturnstile0 (= " || fail "libturnstile-dev does not depend on libturnstile0"
for family in $families; do
  deb=$(deb_of "libturnstile-${family}0")
  case $family in
    redis) needs=libhiredis ;; etcd) needs='libgrpc\+\+' ;; consul) needs=libcurl ;;
    zookeeper) needs="" ;; # the ZooKeeper C client is linked in statically
  esac
  [ -z "$needs" ] || dpkg-deb -f "$deb" Depends | grep -Eq "$needs" || fail "libturnstile-${family}0 does not depend on $needs"
  dpkg-deb -f "$deb" Depends | grep -q "libturnstile0 (= " || fail "libturnstile-${family}0 does not depend on libturnstile0"
  grep -q "^\./usr/lib/$multiarch/turnstile/libturnstile-$family\.so$" "$work/libturnstile-${family}0.files" ||
    fail "libturnstile-${family}0 does not ship /usr/lib/$multiarch/turnstile/libturnstile-$family.so"
  # etcd's module (gRPC) is only suggested: a plain `apt install turnstile` pulls no gRPC.
  field=Recommends
  [ "$family" != etcd ] || field=Suggests
  dpkg-deb -f "$(deb_of turnstile)" $field | grep -q "libturnstile-${family}0" ||
    fail "turnstile's $field does not name libturnstile-${family}0"
done
[ -f "$work/all/usr/include/turnstile/turnstile.hpp" ] || fail "no headers in libturnstile-dev"
[ -n "$(find "$work/all" -name turnstile.pc)" ] || fail "no turnstile.pc in libturnstile-dev"

# The man page: gzip -9n, so no file name and no time stamp in its header (reproducible).
man="$work/all/usr/share/man/man1/turnstile.1.gz"
gzip -t "$man" || fail "no gzipped man page in turnstile"
[ "$(od -An -tx1 -j3 -N5 "$man" | tr -d ' ')" = 0000000000 ] || fail "the man page's gzip header keeps a name or a time (not -n)"
# The host-wide directory: its tmpfiles.d line, and the maintainer scripts that make its group.
grep -q "^d /run/lock/turnstile 2770 root turnstile -" "$work/all/usr/lib/tmpfiles.d/turnstile.conf" ||
  fail "turnstile has no tmpfiles.d line for /run/lock/turnstile"
dpkg-deb -e "$(deb_of turnstile)" "$work/control"
grep -q "addgroup --system turnstile" "$work/control/postinst" || fail "turnstile's postinst makes no turnstile group"

# The CLI with libturnstile0 and turnstile only: file:// works; a network scheme names its package.
for package in libturnstile0 turnstile; do dpkg-deb -x "$(deb_of $package)" "$work/plain"; done
cli="$work/plain/usr/bin/turnstile"
env -u LD_LIBRARY_PATH "$cli" --version | grep -q "^turnstile " || fail "the packaged CLI does not start"
env -u LD_LIBRARY_PATH "$cli" run --backend "file://$work/state" --lock job -- true || fail "the packaged CLI cannot lock"
status=0
env -u LD_LIBRARY_PATH "$cli" run --backend redis://127.0.0.1:1 --lock job --timeout 2 -- true 2>"$work/err" || status=$?
grep -q "libturnstile-redis0" "$work/err" || fail "redis:// without its package does not name libturnstile-redis0 ($status): $(cat "$work/err")"
# With every package: the modules are found.
cli="$work/all/usr/bin/turnstile"
case " $families " in
  *" consul "*)
    status=0
    env -u LD_LIBRARY_PATH "$cli" run --backend consul://127.0.0.1:1 --lock job --timeout 2 -- true 2>"$work/err" || status=$?
    [ "$status" -eq 69 ] || fail "consul://127.0.0.1:1: expected 69 (module found, server unreachable), got $status: $(cat "$work/err")"
    ;;
esac

# The maintainer scripts, where they cannot touch the machine: a copy of /etc, a tmpfs /run/lock.
if [ "$(id -u)" -eq 0 ] && command -v unshare >/dev/null; then
  mkdir "$work/etc"
  cp -a /etc/. "$work/etc/"
  unshare -m sh -eu -c '
    mount --make-rprivate /
    mount --bind "$1/etc" /etc
    mount -t tmpfs -o mode=1777 turnstile-deb-test /run/lock
    sh "$1/control/postinst" configure
    sh "$1/control/postinst" configure
    getent group turnstile >/dev/null || { echo "FAIL: postinst made no group turnstile" >&2; exit 1; }
    [ "$(stat -c "%a %U %G" /run/lock/turnstile)" = "2770 root turnstile" ] ||
      { echo "FAIL: /run/lock/turnstile is $(stat -c "%a %U %G" /run/lock/turnstile)" >&2; exit 1; }
    sh "$1/control/postrm" purge
    [ ! -e /run/lock/turnstile ] || { echo "FAIL: postrm purge left /run/lock/turnstile" >&2; exit 1; }
  ' sh "$work" || fail "the maintainer scripts"
  echo "postinst makes the group and /run/lock/turnstile (2770 root:turnstile); postrm purge removes it"
fi
echo "the .deb files: dependencies, file lists, copyright, man page; they unpack and run"
