#!/bin/sh
# The installed package, checked from outside the build.
#   tests/install/check.sh install BUILD_DIR PREFIX
#       installs the "dparallel" component into a fresh PREFIX and checks its
#       files: headers, the library with its soname links, dparallel.pc and
#       the CMake package with its SameMajorVersion version file
#   tests/install/check.sh headers PREFIX WORK_DIR
#       every installed header compiles alone as C99, C++11 and C++17, and
#       reads nothing outside PREFIX but the C library's own headers
#   tests/install/check.sh pkgconfig PREFIX WORK_DIR
#       builds tests/install/consumer.c with `pkg-config --cflags --libs
#       dparallel` and a plain compiler call, and runs it
#   tests/install/check.sh cmake PREFIX WORK_DIR
#       builds it as a separate CMake project with find_package(dparallel)
#       and runs it
# From the environment: DP_CMAKE, DP_CC, DP_CXX, DP_LIBDIR (the install's
# lib directory, relative to PREFIX) and DP_CONSUMER_FLAGS (compile and link
# flags for the consumers, the sanitizers in a sanitized build).
# The consumers run with LD_LIBRARY_PATH unset: they find the library through
# their RUNPATH, and must load the copy in PREFIX.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
step=${1:?usage: tests/install/check.sh install|headers|pkgconfig|cmake ...}
shift
cmake=${DP_CMAKE:-cmake}
cc=${DP_CC:-cc}
cxx=${DP_CXX:-c++}
libdir=${DP_LIBDIR:-lib}
flags=${DP_CONSUMER_FLAGS:-}

die() {
  echo "FAIL: $*" >&2
  exit 1
}

# The consumer's output must show the sum computed across cpu:0 and cpu:1
# and the library loaded from the prefix.
run_consumer() {  # program, prefix
  out=$(env -u LD_LIBRARY_PATH timeout -s KILL 60 "$1" 2>&1) || die "$1 failed: $out"
  echo "$out"
  echo "$out" | grep -q -x "dparallel [0-9]*: cpu:0 + cpu:1 = 11 22 33 44" || die "$1 printed no correct sum"
  lib=$(cd "$2/$libdir" && pwd -P)
  echo "$out" | grep -q -x "loaded $lib/libdparallel\.so\.[0-9.]*" || die "$1 did not load the library in $lib"
}

case "$step" in
  install)
    build=$1
    prefix=$2
    rm -rf "$prefix"
    "$cmake" --install "$build" --prefix "$prefix" --component dparallel
    for f in include/dparallel/dparallel.h include/dparallel/dp_api.h "$libdir/pkgconfig/dparallel.pc" \
      "$libdir/cmake/dparallel/dparallelConfig.cmake" "$libdir/cmake/dparallel/dparallelConfigVersion.cmake" \
      "$libdir/cmake/dparallel/dparallelTargets.cmake"; do
      [ -f "$prefix/$f" ] || die "$f is not installed"
    done
    # libdparallel.so -> libdparallel.so.MAJOR -> libdparallel.so.MAJOR.MINOR.PATCH
    lib="$prefix/$libdir"
    [ -L "$lib/libdparallel.so" ] || die "$libdir/libdparallel.so is not a link"
    soname_link=$(readlink "$lib/libdparallel.so")
    case "$soname_link" in libdparallel.so.[0-9]*) ;; *) die "libdparallel.so points to $soname_link" ;; esac
    [ -L "$lib/$soname_link" ] || die "$soname_link is not a link"
    real=$(readlink "$lib/$soname_link")
    [ -f "$lib/$real" ] && [ ! -L "$lib/$real" ] || die "$soname_link points to $real, not the library"
    case "$real" in "$soname_link".[0-9]*.[0-9]*) ;; *) die "$real is not $soname_link.MINOR.PATCH" ;; esac
    readelf -d "$lib/$real" | grep -q "Library soname: \[$soname_link\]" || die "$real has not the soname $soname_link"
    # SameMajorVersion: any version of this major at or below the installed one.
    version=${real#libdparallel.so.}
    major=${soname_link#libdparallel.so.}
    compatible() {  # requested version -> TRUE/FALSE
      "$cmake" -DPACKAGE_FIND_VERSION="$1" -DVERSION_FILE="$prefix/$libdir/cmake/dparallel/dparallelConfigVersion.cmake" \
        -P "$here/version_compatible.cmake" 2>&1
    }
    [ "$(compatible "$major.0")" = TRUE ] || die "the package refuses $major.0, its own major"
    [ "$(compatible "$version")" = TRUE ] || die "the package refuses its own version $version"
    [ "$(compatible "$((major + 1)).0")" = FALSE ] || die "the package accepts major $((major + 1))"
    echo "installed dparallel $version into $prefix"
    ;;

  headers)
    prefix=$1
    work=$2
    rm -rf "$work"
    mkdir -p "$work"
    # The C library's headers: whatever these standard headers read.
    std="assert ctype errno float inttypes limits locale math setjmp signal stdarg stdbool stddef stdint stdio \
      stdlib string time wchar wctype"
    for h in $std; do echo "#include <$h.h>"; done >"$work/libc.c"
    cp "$work/libc.c" "$work/libc.cpp"
    deps() {  # compiler, flags, source -> one file a line
      # shellcheck disable=SC2086
      "$1" $2 -M -I"$prefix/include" "$3" | sed -e 's/\\$//' | tr ' ' '\n' | grep -v -e ':$' -e '^$' -e "^$3\$"
    }
    checked=0
    for lang in "c -std=c99" "c++ -std=c++11" "c++ -std=c++17"; do
      std_flag=${lang#* }
      case "$lang" in c\ *) compiler=$cc ext=c ;; *) compiler=$cxx ext=cpp ;; esac
      deps "$compiler" "$std_flag" "$work/libc.$ext" | sort -u >"$work/allowed"
      for header in "$prefix"/include/dparallel/*.h; do
        name=$(basename "$header")
        tu="$work/$name.$ext"
        printf '#include <dparallel/%s>\n#include <dparallel/%s>\nint main(void) { return 0; }\n' "$name" "$name" >"$tu"
        # shellcheck disable=SC2086
        "$compiler" $std_flag -pedantic-errors -Wall -Wextra -Werror -fsyntax-only -I"$prefix/include" "$tu" ||
          die "<dparallel/$name> does not compile alone ($lang)"
        checked=$((checked + 1))
      done
      # dparallel.h includes every other header: what it reads, they read.
      deps "$compiler" "$std_flag" "$work/dparallel.h.$ext" | sort -u >"$work/deps"
      grep -q -x -F "$prefix/include/dparallel/dp_dlpack.h" "$work/deps" || die "no dependencies listed ($lang)"
      while read -r f; do
        case "$f" in "$prefix"/*) continue ;; esac
        grep -q -x -F "$f" "$work/allowed" || echo "$f"
      done <"$work/deps" >"$work/outside"
      if [ -s "$work/outside" ]; then
        die "<dparallel/dparallel.h> ($lang) reads files outside $prefix that are no C library header: $(tr '\n' ' ' <"$work/outside")"
      fi
    done
    [ "$checked" -ge 30 ] || die "only $checked header checks ran"
    echo "$checked header checks: each installed header compiles alone and reads only $prefix and the C library"
    ;;

  pkgconfig)
    prefix=$1
    work=$2
    rm -rf "$work"
    mkdir -p "$work"
    command -v pkg-config >/dev/null 2>&1 || die "pkg-config not found (cmake/install-deps.sh installs it)"
    # Only the prefix's .pc files: no dparallel.pc elsewhere on the machine.
    export PKG_CONFIG_LIBDIR="$prefix/$libdir/pkgconfig"
    unset PKG_CONFIG_PATH
    pc_flags=$(pkg-config --cflags --libs dparallel)
    pc_libdir=$(pkg-config --variable=libdir dparallel)
    echo "pkg-config --cflags --libs dparallel: $pc_flags"
    [ "$(cd "$pc_libdir" && pwd -P)" = "$(cd "$prefix/$libdir" && pwd -P)" ] || die "dparallel.pc names libdir $pc_libdir"
    # shellcheck disable=SC2086
    "$cc" -std=c99 -pedantic -Wall -Wextra -Werror $flags "$here/consumer.c" -o "$work/consumer" $pc_flags \
      -Wl,-rpath,"$pc_libdir"
    run_consumer "$work/consumer" "$prefix"
    ;;

  cmake)
    prefix=$1
    work=$2
    rm -rf "$work"
    mkdir -p "$work"
    "$cmake" -S "$here/cmake_consumer" -B "$work" -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER="$cc" \
      -DCMAKE_C_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="$flags" -DCMAKE_PREFIX_PATH="$prefix" \
      -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF >"$work/configure.log" 2>&1 ||
      { cat "$work/configure.log"; die "the consumer project does not configure"; }
    found=$(grep -- "-- dparallel " "$work/configure.log" || true)
    echo "$found"
    case "$found" in *" from $prefix/$libdir/cmake/dparallel") ;; *) die "find_package did not take $prefix's package" ;; esac
    "$cmake" --build "$work" >"$work/build.log" 2>&1 || { cat "$work/build.log"; die "the consumer does not build"; }
    run_consumer "$work/consumer" "$prefix"
    ;;

  *)
    echo "usage: tests/install/check.sh install|headers|pkgconfig|cmake ..." >&2
    exit 2
    ;;
esac
