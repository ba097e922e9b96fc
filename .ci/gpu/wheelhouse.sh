#!/usr/bin/env bash
# A slim offline wheelhouse for a CUDA machine without network whose python (3.12) already holds torch 2.11 (cu130),
# transformers 5.17, peft, accelerate, triton, pyarrow, pandas, numpy: what Unsloth's GRPO path and TRL need beyond
# that, under 64 MiB. Unsloth's wheel carries its web studio (studio/, ~85 MB unpacked) and bitsandbytes one library
# per CUDA version (~21 MB each): the slim copies keep Unsloth's library and bitsandbytes' CUDA 13 builds.
#
#   .ci/gpu/wheelhouse.sh [DIR=.whl] [PYVER=3.12]     # then carry DIR and, on the GPU machine:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" DIR/*.whl && export PYTHONPATH="$SITE"
#   (and `pip install --no-deps --target "$SITE" .` for this package, or PYTHONPATH="$SITE":.; SITE is any empty folder)
# Versions: the newest Unsloth and what it accepts (trl <= 1.15.0, transformers <= 5.17.0).
set -euo pipefail
dir=${1:-.whl}; py=${2:-3.12}
mkdir -p "$dir"; dir=$(cd "$dir" && pwd)
pkgs=(unsloth==2026.10.9 unsloth_zoo==2026.10.9 bitsandbytes==0.50.2 trl==1.15.0 datasets==4.8.5 dill==0.4.1
      multiprocess==0.70.19 tyro==1.0.17 docstring-parser typeguard==4.6.1 shtab msgspec==0.22.0
      cut_cross_entropy==25.1.1 hf_transfer json5==0.17.3 nest-asyncio==1.6.0 structlog==26.1.0 pydantic==2.14.4
      pydantic-core annotated-types==0.8.0 typing-inspection==0.4.5 torchao==0.18.0 diffusers==0.42.1
      lazy-importer==0.1.0)
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
tmp=$(mktemp -d)
# pydantic-core's version is pinned by pydantic's metadata: resolve it first
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp "${plat[@]}" \
  -d "$tmp" "pydantic==2.14.4"
core=$(unzip -p "$tmp"/pydantic-2.14.4-*.whl '*/METADATA' | sed -n 's/^Requires-Dist: pydantic-core==\([^ ;]*\).*/\1/p')
pkgs=("${pkgs[@]/#pydantic-core/pydantic-core==$core}")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp "${plat[@]}" \
  -d "$tmp" "${pkgs[@]}"
slim() {  # slim WHEEL PATTERN...: drop the members matching any pattern, and their RECORD lines
  local wheel=$1; shift
  python3 - "$wheel" "$@" <<'PY'
import re, sys, zipfile, os
wheel, patterns = sys.argv[1], [re.compile(p) for p in sys.argv[2:]]
out = wheel + ".slim"
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
    for item in src.infolist():
        if any(p.search(item.filename) for p in patterns):
            continue
        data = src.read(item.filename)
        if item.filename.endswith(".dist-info/RECORD"):
            data = "".join(l for l in data.decode().splitlines(True)
                           if not any(p.search(l.split(",")[0]) for p in patterns)).encode()
        dst.writestr(item, data)
os.replace(out, wheel)
PY
}
slim "$tmp"/unsloth-2026.10.9-*.whl '^studio/'
slim "$tmp"/bitsandbytes-*.whl 'libbitsandbytes_cuda1[0-2][0-9]\.so$'
rm -f "$dir"/*.whl; mv "$tmp"/*.whl "$dir"/; rm -rf "$tmp"
ls -l "$dir" | awk 'NR>1 {s+=$5; print $5, $9} END {printf "%d files, %.1f MiB\n", NR-1, s/1048576}'
