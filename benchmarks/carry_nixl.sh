#!/usr/bin/env bash
# NIXL for the device machine (cuda_session.sh unzips it): nixl-cu13's wheel for its python3.12 /
# torch cu130, trimmed to what the UCX backend loads (the wheel's 56 MiB, with its EP extension,
# object-store and other plugins, does not fit the 64 MiB carry beside .carry): a 12 MiB zip in
# .carry-nixl/ (gitignored). Its own deps, numpy and torch, are in the GPU image.
set -euo pipefail
VERSION=${NIXL_VERSION:-1.5.1}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  -d "$work/whl" "nixl-cu13==$VERSION"
mkdir "$work/site" && python3 -m zipfile -e "$work"/whl/*.whl "$work/site"
cd "$work/site"
rm -rf nixl_ep_cu13 nixl_cu13.scripts nixl_cu13-*.data
find nixl_cu13.libs/nixl .nixl_cu13.mesonpy.libs/plugins -type f ! -name libplugin_UCX.so -delete
rm -f nixl_cu13.libs/ucx/libucx_perftest* nixl_cu13.libs/ucx/libuct_ib*
python3 - <<'PY'    # drop every bundled library nothing kept needs (readelf's NEEDED, transitively)
import os, subprocess
libs = {f: os.path.join(d, f) for d in ("nixl_cu13.libs", ".nixl_cu13.mesonpy.libs") for f in os.listdir(d)}
todo = [os.path.join(r, f) for r, _, fs in os.walk(".") for f in fs   # the bindings, the UCX plugin, UCX's modules
        if ".so" in f and (r == "./nixl_cu13" or f == "libplugin_UCX.so" or r.endswith("/ucx"))]
keep = set()
while todo:
    f = todo.pop()
    if f in keep:
        continue
    keep.add(os.path.normpath(f))
    for line in subprocess.run(["readelf", "-d", f], capture_output=True, text=True).stdout.splitlines():
        if "(NEEDED)" in line and (name := line.split("[")[1].rstrip("]")) in libs:
            todo.append(libs[name])
for path in libs.values():
    if os.path.isfile(path) and ".so" in path and os.path.normpath(path) not in keep:
        os.remove(path)
PY
cd - >/dev/null
mkdir -p .carry-nixl && rm -f .carry-nixl/*.zip
python3 - "$work/site" ".carry-nixl/nixl_cu13-$VERSION-cp312-ucx-only.zip" <<'PY'
import os, sys, zipfile
site, out = sys.argv[1:]
with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for r, _, fs in os.walk(site):
        for f in fs:
            z.write(os.path.join(r, f), os.path.relpath(os.path.join(r, f), site))
PY
ls -la .carry-nixl
