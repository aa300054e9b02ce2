"""Per-token time of the guided path's parts, new design (masks on the step thread after the decode launch),
for the nested modes: each constrained run and its twin; microseconds per generated token.

    LLAMA_SERVE_TUNE_THREADS=1 python docs/results/forced_call_nested_64385e5/profile_new.py 8 out.json [TEMPERATURE]
"""

import sys
import time
import json
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from serving.engine import llama
from serving.engine import guided as G
from measure.constrained import modes
from scripts.bench_constrained import run
from serving.engine.config import EngineConfig
from serving.engine.core import Engine

spent = {}


def wrap(owner, attr, key):
    m = getattr(owner, attr)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return m(*a, **k)
        finally:
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - t

    setattr(owner, attr, timed)


wrap(G.DueMasks, "compute", "mask (after the decode launch)")
wrap(G.Guided, "advance", "advance (consume_token)")
wrap(G.Guided, "best", "best (refused: pick from the mask)")
wrap(llama.SamplerChain, "sample", "sample (all of it)")
wrap(llama.LlamaContext, "greedy_no_eog", "twin greedy (EOS banned)")
wrap(llama.LlamaContext, "decode", "decode call (+ masks)")
R = int(sys.argv[1])
T = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0  # temperature
engine = Engine(EngineConfig(n_parallel=1, n_ctx=2048, seed=1, cache_ram_mib=0))
table = {m: modes()[m] for m in ("json_schema_nested", "tool_call_nested")}
acc = {}
toks = {}
for r in range(R + 1):
    for name, mode in table.items():
        for kind in ("constrained", "twin"):
            spent.clear()
            if kind == "constrained":
                c = run(engine, mode.text, mode.guide, mode.tools, r + 1, 160, temperature=T)
                n = c["tokens"]
            else:
                run(engine, mode.text, None, mode.tools, r + 1, n, ignore_eos=True, temperature=T)
            if r == 0:
                continue  # warm-up
            d = acc.setdefault(f"{name} {kind}", {})
            for k, v in spent.items():
                d[k] = d.get(k, 0.0) + v
            toks[f"{name} {kind}"] = toks.get(f"{name} {kind}", 0) + n
engine.close()
out = {key: {k: round(1e6 * v / toks[key], 1) for k, v in sorted(d.items())} for key, d in acc.items()}
print(json.dumps(out, indent=1))
if len(sys.argv) > 2:
    open(sys.argv[2], "w").write(
        json.dumps({"rounds": R, "temperature": T, "us_per_token": out, "tokens": toks}, indent=1)
    )
