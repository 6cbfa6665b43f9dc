#!/usr/bin/env bash
# Builds the libFuzzer targets `fuzz/build/batch`, `fuzz/build/checkpoint` and `fuzz/build/media` from
# the library's own C sources (libuform/src/*.c, ram/*.c, media/*.c) with -fsanitize=fuzzer,address,undefined.
#
#   fuzz/build.sh            # needs clang (14 or later) with its runtimes, libomp, and a Python
#                            # that imports scipy_openblas32 (PYTHON=... picks which, CC=... the clang)
#   fuzz/build/batch fuzz/corpus/batch -rss_limit_mb=1024 -malloc_limit_mb=512     # .ci/fuzz runs both
#
# The CPU backend's pragmas are OpenMP and it calls omp_get_thread_num(), so the targets build with
# clang's -fopenmp and link libomp (Debian: libomp-14-dev). OpenBLAS comes from the scipy-openblas32
# wheel, found through its own module, and is found again at run time through an rpath.
set -euo pipefail
cd "$(dirname "$0")/.."

CC=${CC:-}
if [ -z "$CC" ]; then
    for candidate in clang clang-19 clang-18 clang-17 clang-16 clang-15 clang-14; do
        if command -v "$candidate" >/dev/null; then CC=$candidate; break; fi
    done
fi
[ -n "$CC" ] || { echo "fuzz/build.sh: no clang on PATH; set CC" >&2; exit 1; }
PYTHON=${PYTHON:-python3}
read -r OPENBLAS_INCLUDE OPENBLAS_LIB < <("$PYTHON" -c \
    "import scipy_openblas32 as s; print(s.get_include_dir(), s.get_lib_dir())")

mkdir -p fuzz/build
flags=(-g -O1 -fno-omit-frame-pointer -fopenmp -fsanitize=address,undefined -fno-sanitize-recover=all
       -Wall -Wno-unused-function -Wno-pass-failed
       -Ilibuform/include -Ilibuform/src -I"$OPENBLAS_INCLUDE")
libs=(-L"$OPENBLAS_LIB" -lscipy_openblas -Wl,-rpath,"$OPENBLAS_LIB" -lm -lpthread)
sources=(libuform/src/*.c libuform/src/ram/*.c libuform/src/media/*.c)
# The media decoders pkg-config finds, as setup.py links them; the libraries themselves are not instrumented.
media=()
for family in "JPEG libjpeg" "PNG libpng" "WEBP libwebp" "FFMPEG libavformat libavcodec libavutil libswresample libswscale"; do
    read -r -a words <<<"$family"
    if pkg-config --exists "${words[@]:1}" 2>/dev/null; then
        media+=("-DUFORM_MEDIA_${words[0]}=1")
        read -r -a found <<<"$(pkg-config --cflags "${words[@]:1}")"
        flags+=("${found[@]}")
        read -r -a found <<<"$(pkg-config --libs "${words[@]:1}")"
        libs+=("${found[@]}")
    fi
done
flags+=("${media[@]}")
echo "fuzz/build.sh: media decoders: ${media[*]:-none}"

# The library's objects once, then each target links them with its own entry point. The shared
# core (validation, packing, checkpoints, verbs) gets coverage, AddressSanitizer and UBSan. The CPU
# backend's kernels get AddressSanitizer alone at -O2: their loops hold no branch on the input worth
# steering toward, and coverage hooks plus UBSan in them made one step 5 to 10 times slower
# (13 ms instead of 1.3 ms for a two-item step on the tiny trainer).
objects=() jobs=()
for source in "${sources[@]}"; do
    object=fuzz/build/$(echo "${source%.c}" | tr / _).o
    case "$source" in
        libuform/src/ram/*) extra=(-O2 -fno-math-errno -fno-sanitize=undefined) ;;
        *) extra=(-fsanitize=fuzzer-no-link) ;;
    esac
    "$CC" "${flags[@]}" "${extra[@]}" -c "$source" -o "$object" &
    objects+=("$object") jobs+=($!)
done
for job in "${jobs[@]}"; do wait "$job"; done
jobs=()
for target in batch checkpoint media; do
    "$CC" "${flags[@]}" -fsanitize=fuzzer "fuzz/$target.c" "${objects[@]}" "${libs[@]}" -o "fuzz/build/$target" &
    jobs+=($!)
done
for job in "${jobs[@]}"; do wait "$job"; done
echo "built fuzz/build/batch, fuzz/build/checkpoint and fuzz/build/media with $CC"
