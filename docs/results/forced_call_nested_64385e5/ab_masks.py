#!/usr/bin/env python3
"""A/B in one process: a guide's mask on a worker thread (old: 9c47bf4's serving/engine/guided.py, MaskWorker)
against the mask computed on the step thread once the decode is launched (new: DueMasks), on the same requests.

Each round runs, per mode and in a rotated order, old constrained + its unconstrained twin and new constrained +
its twin (the twin: same prompt, as many tokens, EOS ignored; greedy, so old and new make the same tokens).
Reported: each implementation's paired ratio to its twin, and new/old on the constrained runs, each the median
over rounds with the 95% interval of the median (measure/design.py).

    git show 9c47bf4:serving/engine/guided.py > /tmp/old_guided.py
    REPO=. python docs/results/forced_call_nested_64385e5/ab_masks.py /tmp/old_guided.py --rounds 24 --out ab.json

Kept beside its results (it swaps the engine's implementation in place, so it is no benchmark of scripts/).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

REPO = Path(os.environ.get("REPO", Path(__file__).resolve().parents[3]))
sys.path.insert(0, str(REPO))
from serving.engine import llama  # noqa: E402
from serving.engine import guided  # noqa: E402
from measure.constrained import modes  # noqa: E402
from measure.design import median_interval, rotated  # noqa: E402
from measure.provenance import provenance  # noqa: E402
from scripts.bench_constrained import run  # noqa: E402
from serving.engine.config import THREADS_ENV, EngineConfig  # noqa: E402
from serving.engine.core import Engine  # noqa: E402


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("old_guided", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    class OldMasks(module.MaskWorker):
        def compute(self) -> None:  # the new decode hook: nothing due with a worker
            pass

    return module, OldMasks


def use(ctx, which, old, old_masks):
    if which == "old":
        llama.Guided = old.Guided
        ctx.masks = old_masks
    else:
        llama.Guided = guided.Guided
        ctx.masks = guided.DueMasks()


def interval(values):
    each = sorted(values)
    return {"median": statistics.median(each), "ci95": median_interval(each), "each": each}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("old")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--gen-tokens", type=int, default=160)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--modes", default="json_schema_nested,tool_call_nested")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    old, OldMasks = load_old(a.old)
    engine = Engine(EngineConfig(n_parallel=1, n_ctx=2048, seed=1, cache_ram_mib=0))
    ctx = engine._ctx
    old_masks = OldMasks()
    table = {m: modes()[m] for m in a.modes.split(",")}
    arms = [(m, w) for m in table for w in ("old", "new")]
    rows = {arm: [] for arm in arms}
    try:
        for m, w in arms:  # warm-up
            use(ctx, w, old, old_masks)
            run(engine, table[m].text, table[m].guide, table[m].tools, 0, 16)
        for r in range(a.rounds):
            for m, w in rotated(arms, r):
                mode = table[m]
                use(ctx, w, old, old_masks)
                c = run(engine, mode.text, mode.guide, mode.tools, r + 1, a.gen_tokens, temperature=a.temperature)
                t = run(
                    engine, mode.text, None, mode.tools, r + 1, c["tokens"], ignore_eos=True, temperature=a.temperature
                )
                rows[(m, w)].append({"constrained": c, "twin": t})
            print(
                f"round {r + 1}: "
                + ", ".join(
                    f"{m}/{w} {rows[(m, w)][-1]['constrained']['decode_tok_s']:.1f}/"
                    f"{rows[(m, w)][-1]['twin']['decode_tok_s']:.1f}"
                    for m, w in arms
                ),
                flush=True,
            )
    finally:
        use(ctx, "new", old, old_masks)
        old_masks.close()
        engine.close()
    out = {
        "provenance": provenance(),
        "old": a.old,
        "rounds": a.rounds,
        "gen_tokens": a.gen_tokens,
        "temperature": a.temperature,
        "threads_env": os.environ.get(THREADS_ENV),
        "modes": {},
    }
    for m in table:
        o, n = rows[(m, "old")], rows[(m, "new")]
        ratio = {
            w: interval([x["constrained"]["decode_tok_s"] / x["twin"]["decode_tok_s"] for x in rows[(m, w)]])
            for w in ("old", "new")
        }
        new_over_old = interval(
            [y["constrained"]["decode_tok_s"] / x["constrained"]["decode_tok_s"] for x, y in zip(o, n, strict=False)]
        )
        same = all(x["constrained"]["tokens"] == y["constrained"]["tokens"] for x, y in zip(o, n, strict=False))
        out["modes"][m] = {
            "vs_twin": ratio,
            "new_over_old": new_over_old,
            "same_token_counts": same,
            "runs": {w: rows[(m, w)] for w in ("old", "new")},
        }
        print(
            f"{m}: old x twin {ratio['old']['median']:.3f} {ratio['old']['ci95']}, new x twin "
            f"{ratio['new']['median']:.3f} {ratio['new']['ci95']}, new/old {new_over_old['median']:.3f} "
            f"{new_over_old['ci95']}, same token counts {same}"
        )
    a.out.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
