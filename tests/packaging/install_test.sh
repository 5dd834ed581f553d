#!/bin/sh
# SPDX-License-Identifier: Apache-2.0
# An installed turnstile as another project sees it: `cmake --install` into a temporary prefix,
# a consumer built with find_package(turnstile) and one with pkg-config, both run; then the tree
# is moved elsewhere (the build tree's libraries out of reach) and the installed CLI runs and
# finds its backend modules, with no RUNPATH pointing into the build tree.
#   install_test.sh BUILD_DIR SOURCE_DIR
set -eu
build=$1
source=$2
work=$(mktemp -d /tmp/turnstile-install-test-XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

cmake --install "$build" --prefix "$work/prefix" >/dev/null
libdir=$(dirname "$(find "$work/prefix" -name libturnstile.so -type l | head -n 1)")
[ -n "$libdir" ] || fail "no libturnstile.so installed"
for module in "$libdir"/turnstile/libturnstile-*.so; do [ -f "$module" ] || fail "no backend modules in $libdir/turnstile"; done
[ -x "$work/prefix/bin/turnstile" ] || fail "no CLI installed"
gzip -t "$work/prefix/share/man/man1/turnstile.1.gz" || fail "no gzipped man page installed"

# find_package
cmake -S "$source/tests/packaging/consumer" -B "$work/cmake-consumer" -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/cmake-consumer" >/dev/null
"$work/cmake-consumer/consumer" "file://$work/state" | grep -q "^turnstile [0-9.]*, token [1-9]" || fail "the find_package consumer did not lock"

# examples/ as a project of its own
cmake -S "$source/examples" -B "$work/examples" -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/examples" --target example_mutex >/dev/null
"$work/examples/example_mutex" "file://$work/state" >/dev/null || fail "the standalone example did not run"

# pkg-config
pc=$(dirname "$(find "$work/prefix" -name turnstile.pc | head -n 1)")
flags=$(PKG_CONFIG_PATH="$pc" pkg-config --cflags --libs turnstile) || fail "pkg-config does not know turnstile"
# shellcheck disable=SC2086
g++ -std=c++20 -o "$work/pc-consumer" "$source/tests/packaging/consumer/main.cpp" $flags -Wl,-rpath,"$libdir"
"$work/pc-consumer" "file://$work/state" | grep -q "^turnstile [0-9.]*, token [1-9]" || fail "the pkg-config consumer did not lock"

# Relocated: nothing may point into the build tree, and the CLI must find its modules.
for binary in "$work/prefix/bin/turnstile" "$libdir"/libturnstile.so.* "$libdir"/turnstile/*.so; do
  if readelf -d "$binary" | grep -E "RPATH|RUNPATH" | grep -q "$build"; then fail "$binary has a RUNPATH into the build tree"; fi
done
mv "$work/prefix" "$work/moved"
cli="$work/moved/bin/turnstile"
env -u LD_LIBRARY_PATH "$cli" --version | grep -q "^turnstile " || fail "the moved CLI does not start"
env -u LD_LIBRARY_PATH "$cli" run --backend "file://$work/state" --lock job -- true || fail "the moved CLI cannot lock"
for url in redis://127.0.0.1:1 etcd://127.0.0.1:1 zk://127.0.0.1:1 consul://127.0.0.1:1; do
  scheme=${url%%:*}
  case "$scheme" in zk) family=zookeeper ;; *) family=$scheme ;; esac
  if [ -f "$work/moved/${libdir#"$work/prefix/"}/turnstile/libturnstile-$family.so" ]; then
    status=0
    env -u LD_LIBRARY_PATH "$cli" run --backend "$url" --lock job --timeout 2 --connect-timeout 2 -- true 2>"$work/err" || status=$?
    [ "$status" -eq 69 ] || fail "$url: expected 69 (unreachable), got $status: $(cat "$work/err")"
  fi
done
echo "install, find_package, pkg-config and a moved tree: all fine"
