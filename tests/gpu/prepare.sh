#!/usr/bin/env bash
# Run HERE (a Debian 12 machine with the project's packages) before tests/gpu/run.sh: copies the
# libraries a bare GPU machine lacks (OpenBLAS, Gloo and their runtime deps, GoogleTest sources)
# into .gpu-deps/, which the device tool carries (`carry: [".gpu-deps"]`). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/lib/common.sh
ensure_packages
deps=.gpu-deps
rm -rf "$deps" && mkdir -p "$deps"/{lib,include/openblas,share/cmake}

blas_dir=/usr/include/x86_64-linux-gnu/openblas-pthread
cp "$blas_dir"/*.h "$deps/include/openblas/"
blas_so="$(readlink -f /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so)"
cp "$blas_so" "$deps/lib/libopenblas.so.0"
ln -s libopenblas.so.0 "$deps/lib/libopenblas.so"

cp -r /usr/include/gloo "$deps/include/"
cp /usr/lib/libgloo.so.0.5.0 "$deps/lib/"
ln -s libgloo.so.0.5.0 "$deps/lib/libgloo.so"
cp -r /usr/share/cmake/Gloo "$deps/share/cmake/"
# Debian's Gloo config names /usr/lib absolutely; point it at the carried copy.
sed -i 's|"/usr/lib/libgloo.so.0.5.0"|"${_IMPORT_PREFIX}/lib/libgloo.so.0.5.0"|' \
  "$deps"/share/cmake/Gloo/GlooTargets-*.cmake

# Runtime dependencies of the two shared libraries that a CUDA image may not have.
for so in "$deps/lib/libopenblas.so.0" "$deps/lib/libgloo.so.0.5.0"; do
  ldd "$so" | awk '/=> \// {print $3}' | while read -r dep; do
    case "$(basename "$dep")" in
      libc.so*|libm.so*|libstdc++*|libgcc_s*|ld-linux*|libpthread*|libdl*|librt*) ;;
      *) cp -n "$(readlink -f "$dep")" "$deps/lib/$(basename "$dep")" ;;
    esac
  done
done

# CLI11 (header-only) for geofp8-bench: its config finds the headers three levels above itself.
cp -r /usr/include/CLI "$deps/include/"
cp -r /usr/share/cmake/CLI11 "$deps/share/cmake/"

cp -r /usr/src/googletest "$deps/googletest"
du -sh "$deps"
