"""Per-token time of the guided path's parts, old design (9c47bf4: the mask on a worker thread), nested modes;
microseconds per generated token (the worker's mask is on its own thread, beside the decode).

    git show 9c47bf4:serving/engine/guided.py > /tmp/old_guided.py
    LLAMA_SERVE_TUNE_THREADS=1 python docs/results/forced_call_nested_64385e5/profile_old.py \
        8 out.json /tmp/old_guided.py [TEMPERATURE]
"""

import sys
import time
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE))
from serving.engine import llama
from ab_masks import load_old
from measure.constrained import modes
from scripts.bench_constrained import run
from serving.engine.config import EngineConfig
from serving.engine.core import Engine

old, OldMasks = load_old(sys.argv[3])
spent = {}


def add(k, t):
    spent[k] = spent.get(k, 0.0) + time.perf_counter() - t


class Timed(old.Guided):
    def _ready(self):
        t = time.perf_counter()
        g = super()._ready()
        add("wait for the worker's mask", t)
        return g

    def advance(self, token):
        guide = self._ready()
        t = time.perf_counter()
        guide.consume_token(token)
        add("consume_token", t)
        t = time.perf_counter()
        self._pending = self._worker.submit(guide, self._mask)
        add("hand the next mask to the worker", t)


orig_run = old.MaskJob.run


def mrun(self):
    t = time.perf_counter()
    orig_run(self)
    add("mask (worker thread)", t)


old.MaskJob.run = mrun


def wrap(owner, attr, key):
    m = getattr(owner, attr)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return m(*a, **k)
        finally:
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - t

    setattr(owner, attr, timed)


wrap(old.Guided, "best", "best (refused: pick from the mask)")
wrap(llama.SamplerChain, "sample", "sample (all of it)")
wrap(llama.LlamaContext, "greedy_no_eog", "twin greedy (EOS banned)")
wrap(llama.LlamaContext, "decode", "decode call")
llama.Guided = Timed
R = int(sys.argv[1])
T = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0  # temperature
engine = Engine(EngineConfig(n_parallel=1, n_ctx=2048, seed=1, cache_ram_mib=0))
engine._ctx.masks = OldMasks()
table = {m: modes()[m] for m in ("json_schema_nested", "tool_call_nested")}
acc = {}
toks = {}
for r in range(R + 1):
    for name, mode in table.items():
        for kind in ("constrained", "twin"):
            spent.clear()
            if kind == "constrained":
                n = run(engine, mode.text, mode.guide, mode.tools, r + 1, 160, temperature=T)["tokens"]
            else:
                run(engine, mode.text, None, mode.tools, r + 1, n, ignore_eos=True, temperature=T)
            if r == 0:
                continue
            d = acc.setdefault(f"{name} {kind}", {})
            for k, v in spent.items():
                d[k] = d.get(k, 0.0) + v
            toks[f"{name} {kind}"] = toks.get(f"{name} {kind}", 0) + n
engine._ctx.masks.close()
engine.close()
out = {key: {k: round(1e6 * v / toks[key], 1) for k, v in sorted(d.items())} for key, d in acc.items()}
print(json.dumps(out, indent=1))
open(sys.argv[2], "w").write(json.dumps({"rounds": R, "temperature": T, "us_per_token": out, "tokens": toks}, indent=1))
