"""The tuner's command line, parsed once into a frozen `SearchOptions`: every later step reads attributes of one
immutable record instead of a Namespace that grows as the study runs.

The flags come in groups (`python -m tuning.search --help`): where the trials run, what is searched, what each
trial measures, how the pick is made, and where the study is kept.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from measure.replay import DEFAULT_CONCURRENCY, DEFAULT_REQUESTS, Builtin
from measure.slo import Slo
from measure.workload import PromptSet
from tuning.prune import DEFAULT_PRUNE_BELOW
from tuning.report import Objective

REPO_ROOT = Path(__file__).resolve().parent.parent
LIVE = "live"  # --workload live: the serving app's recorded traffic
BENCHMARK = "benchmark"  # --workload benchmark: the fixed benchmark even where recorded traffic would be the default
LIVE_MIN_REQUESTS = 32  # in place, the recorded traffic is the default workload once it holds this many


class Where(str, Enum):
    """Where the trials run."""

    auto = "auto"  # in place when a Serve app with engine replicas is running, else offline
    in_place = "in-place"  # on the running app's replicas; an error when none is running
    offline = "offline"  # on engines of the tuner's own, even beside a running app


class Prefer(str, Enum):
    """How the pick is made from the Pareto front."""

    balanced = "balanced"  # best second objective among configs within 5% of the best single stream
    single = "single"
    aggregate = "aggregate"


class Sampler(str, Enum):
    """Optuna's sampler; prior: the memory model's and the roofline's ranking first, then TPE
    (tuning/prior_sampler.py)."""

    tpe = "tpe"
    nsga2 = "nsga2"
    random = "random"
    prior = "prior"


class DeviceChoice(str, Enum):
    auto = "auto"
    gpu = "gpu"
    cpu = "cpu"


@dataclass(frozen=True, kw_only=True)
class SearchOptions:
    """Everything the command line says, validated. Defaults are the command line's."""

    trials: int = 40
    where: Where = Where.auto
    app_name: str | None = None
    ray_address: str | None = None
    serve_address: str = "auto"
    model: str | None = None
    base_config: Path = REPO_ROOT / "configs" / "default.yaml"
    space: Path | None = None
    vram_budget: str | None = None
    ram_budget: str | None = None
    min_ctx_per_slot: int | None = None
    device: DeviceChoice = DeviceChoice.auto
    gen_tokens: int = 64
    repeats: int = 3
    prompt_set: str = PromptSet.plain.value  # a PromptSet's value, or "both"
    min_stream_tok_s: float | None = None
    max_quality_loss: float = 0.01
    workload: str | None = None  # LIVE, a Builtin's value, a JSONL file's path, BENCHMARK; None: as the app allows
    slo: Slo | None = None
    requests: int | None = None  # None: DEFAULT_REQUESTS, or more where the SLO's percentiles need them
    concurrency: int = DEFAULT_CONCURRENCY
    rate: float | None = None
    rate_scale: float = 1.0
    length_scale: float = 1.0
    objective_choice: Objective | None = None  # as given; `objective` says what applies
    prefer_choice: Prefer | None = None
    confirm_rounds: int = 3
    confirm_top: int = 3
    sampler: Sampler = Sampler.tpe
    seed: int = 0
    prune_below: float = DEFAULT_PRUNE_BELOW  # 0: every trial measured in full
    storage: str | None = None
    study_name: str | None = None
    results_dir: Path = REPO_ROOT / "results"
    out: Path = REPO_ROOT / "configs" / "tuned.yaml"
    apply: bool = True

    @property
    def objective(self) -> Objective:
        """The second objective: as given, else goodput on a traffic workload, else the 4-way aggregate."""
        if self.objective_choice is not None:
            return self.objective_choice
        return Objective.goodput if self.traffic else Objective.aggregate

    @property
    def traffic(self) -> bool:
        """Trials replay a traffic workload (known once the tuner has settled --workload)."""
        return self.workload not in (None, BENCHMARK)

    @property
    def prefer(self) -> Prefer:
        """As given, else the best second objective (goodput) on a traffic workload, else balanced."""
        if self.prefer_choice is not None:
            return self.prefer_choice
        return Prefer.aggregate if self.objective is Objective.goodput else Prefer.balanced

    @property
    def replay_requests(self) -> int:
        """Requests a trial replays: --requests, else enough for the SLO's percentiles (p95: 100), at least 64."""
        if self.requests is not None:
            return self.requests
        return max(DEFAULT_REQUESTS, self.slo.min_samples() if self.slo else 0)

    @property
    def workload_prompt_set(self) -> PromptSet:
        """The prompt set the objectives are measured on (`both` measures them on plain)."""
        return PromptSet.plain if self.prompt_set == "both" else PromptSet(self.prompt_set)


class _Help(argparse.HelpFormatter):
    """Each flag's default after its help, unless the help says it already or there is none to show; paths
    shown as the repository-relative paths they are."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default is None or default is argparse.SUPPRESS or action.nargs == 0:
            return text
        if isinstance(default, Path) and default.is_relative_to(REPO_ROOT):
            default = default.relative_to(REPO_ROOT)
        return f"{text} (default: {str(default).replace('%', '%%')})"


def _parser() -> argparse.ArgumentParser:
    d = SearchOptions()
    p = argparse.ArgumentParser(
        prog="python -m tuning.search",
        description="Tune llama.cpp's settings for the model a Serve app serves (in place, on its replicas) or "
                    "for a model of your own (offline), and apply the pick.",
        formatter_class=_Help)
    p.add_argument("--trials", type=int, default=d.trials, help="trials to run")

    where = p.add_argument_group("where the trials run")
    mode = where.add_mutually_exclusive_group()
    mode.add_argument("--in-place", dest="where", action="store_const", const=Where.in_place,
                      help="run on the running Serve app's engine replicas, and fail if none is running (without "
                           "either flag the tuner does this whenever an app is serving)")
    mode.add_argument("--offline", dest="where", action="store_const", const=Where.offline,
                      help="run on engines of the tuner's own even when an app is serving (one more weight load "
                           "per trial actor); the pick is still written to --out and applied to the app")
    where.add_argument("--app-name", help="the Serve app to tune (default: the one running engine replicas)")
    where.add_argument("--ray-address", help="Ray cluster to run offline trials on (default: the Serve app's, "
                                             "else a local Ray started for the study)")
    where.add_argument("--serve-address", default=d.serve_address, help="Ray cluster where the Serve app runs")
    where.add_argument("--device", choices=[c.value for c in DeviceChoice], default=d.device.value,
                       help="offline trials on a GPU, on the CPU, or on a GPU when the cluster has a free one")

    space = p.add_argument_group("what is searched")
    space.add_argument("--model", help="GGUF file for offline trials (default: `model:` of --base-config, else "
                                       "the embedded model); in place the replicas' model is tuned")
    space.add_argument("--base-config", type=Path, default=d.base_config,
                       help="engine config offline trials start from (model, threads)")
    space.add_argument("--space", type=Path, help="search-space YAML (default: configs/search_space.yaml)")
    space.add_argument("--vram-budget", help="memory budget, e.g. 32GiB (default: the GPU's memory minus 1 GiB; "
                                             "on the CPU half this machine's RAM, counted as resident memory)")
    space.add_argument("--ram-budget", help="host memory a config may take when part of the model lives there, "
                                            "e.g. 64GiB (default: three quarters of this machine's RAM)")
    space.add_argument("--min-ctx-per-slot", type=int,
                       help="least context per slot (default: min(2048, the model's training context))")
    space.add_argument("--max-quality-loss", type=float, default=d.max_quality_loss,
                       help="allowed rise of the mean NLL over the f16-cache baseline, nats/token (~1%% perplexity)")

    trial = p.add_argument_group("what each trial measures")
    trial.add_argument("--gen-tokens", type=int, default=d.gen_tokens, help="tokens generated per measured request")
    trial.add_argument("--repeats", type=int, default=d.repeats,
                       help="measured rounds per figure after a warm-up; the median is kept")
    trial.add_argument("--prompt-set", choices=[*(s.value for s in PromptSet), "both"], default=d.prompt_set,
                       help="plain (free writing as raw completions, EOS ignored), chat (the same instructions as "
                            "chat messages), copy (edit code, quote a text: where prompt lookup pays; stops at EOS), "
                            "or both (objectives on plain, the single stream on copy beside)")
    trial.add_argument("--min-stream-tok-s", type=float,
                       help="per-stream floor of the capacity figure, e.g. 10 (a reader's pace); given, every trial "
                            "also measures its capacity curve: 1, 2, 4, ... streams up to its slots")

    traffic = p.add_argument_group("the traffic each trial serves (instead of the fixed benchmark above)")
    traffic.add_argument("--workload", metavar="live|chat|rag|agent|FILE|benchmark",
                         help="live: the serving app's recorded traffic (GET /traffic; in place the default once "
                              f"it holds {LIVE_MIN_REQUESTS} requests); chat, rag, agent: built in; benchmark: the "
                              "fixed benchmark above, in place too; FILE: JSONL of "
                              "request shapes (prompt_tokens, output_tokens, optional arrival, cached_tokens, n, "
                              "kind: the lines of /traffic's recent.requests) or a Mooncake trace (timestamp, "
                              "input_length, output_length, hash_ids). The second objective becomes goodput")
    traffic.add_argument("--slo", metavar="TARGETS",
                         help="latency targets, e.g. ttft_p95=1.5s,itl_p95=80ms (ttft, itl or e2e at p50, p90, p95 or "
                              "p99): goodput counts only requests within them, and a trial that misses one is "
                              "infeasible (the report says by how much)")
    traffic.add_argument("--requests", type=int,
                         help=f"requests replayed per trial (default: {DEFAULT_REQUESTS}, or enough for the SLO's "
                              "percentiles to leave 5 samples beyond them: 100 for a p95, 500 for a p99)")
    traffic.add_argument("--concurrency", type=int, default=d.concurrency,
                         help="closed loop (built-in workloads and files without arrival times): clients, each "
                              "sending its next request when its last one ended")
    traffic.add_argument("--rate", type=float,
                         help="open loop instead: Poisson arrivals at this many requests/s")
    traffic.add_argument("--rate-scale", type=float, default=d.rate_scale,
                         help="open loop at recorded arrival times (live, files with arrivals): their rate times this")
    traffic.add_argument("--length-scale", type=float, default=d.length_scale,
                         help="every prompt, shared prefix and output this many times as long: the workload's mix "
                              "at a size a small machine replays quickly (0.25: rag's 2-6k-token prompts become "
                              "0.5-1.5k)")

    pick = p.add_argument_group("how the pick is made")
    pick.add_argument("--objective", choices=[o.value for o in Objective],
                      help="the second objective beside single-stream tok/s: aggregate (4 streams at once), "
                           "capacity (the best aggregate with every stream at least --min-stream-tok-s) or goodput "
                           "(a traffic workload's requests/s within the SLO; the first objective is then its median "
                           "request's tok/s) (default: goodput with a workload, else aggregate)")
    pick.add_argument("--prefer", choices=[c.value for c in Prefer],
                      help="balanced: the best second objective among configs within 5%% of the best first one; "
                           "single: the best first objective; aggregate: the best second objective (default: "
                           "aggregate on a workload, else balanced)")
    pick.add_argument("--confirm-rounds", type=int, default=d.confirm_rounds,
                      help="after the search, measure the best --confirm-top configs and the baseline this many "
                           "more times, interleaved, and pick on paired ratios (0: pick on the search's figures)")
    pick.add_argument("--confirm-top", type=int, default=d.confirm_top, help="configs of the Pareto front to confirm")
    pick.add_argument("--sampler", choices=[s.value for s in Sampler], default=d.sampler.value,
                      help="Optuna's sampler; prior: TPE whose first 8 proposals are the space ranked by the memory "
                           "model and the bandwidth roofline instead of random ones")
    pick.add_argument("--seed", type=int, default=d.seed, help="the sampler's seed")
    prune = pick.add_mutually_exclusive_group()
    prune.add_argument("--prune-below", type=float, default=d.prune_below,
                       help="measure each trial short first (a quarter of --gen-tokens, one round) and skip its full "
                            "measurement when it is below this share (e.g. 0.8) of the leader's short figure on every "
                            "objective the pick reads (offline, fixed benchmark; never the baseline); default 0: off, "
                            "as it has not paid on CPU (docs/tuning.md)")
    prune.add_argument("--no-prune", dest="prune_below", action="store_const", const=0.0,
                       help="measure every trial in full (--prune-below 0)")

    keep = p.add_argument_group("where the study and the pick go")
    keep.add_argument("--storage", help="Optuna storage URL (default: sqlite:///RESULTS_DIR/optuna.db)")
    keep.add_argument("--study-name", help="default: <model>-<device>-<budget>, with -inplace in place; an existing "
                                          "study is resumed")
    keep.add_argument("--results-dir", type=Path, default=d.results_dir, help="reports, plots and the study")
    keep.add_argument("--out", type=Path, default=d.out, help="the pick's engine config (YAML)")
    keep.add_argument("--no-apply", dest="apply", action="store_false",
                      help="only write --out; leave a running Serve app as it is")
    return p


def parse_options(argv: list[str] | None = None) -> SearchOptions:
    """The command line as a SearchOptions; argparse's usage error (exit 2) on a bad combination."""
    p = _parser()
    ns = p.parse_args(argv)
    if ns.trials < 1:
        p.error("--trials must be at least 1")
    if ns.repeats < 1 or ns.gen_tokens < 2:
        p.error("--repeats must be >= 1 and --gen-tokens >= 2")
    if ns.objective == Objective.capacity.value and ns.min_stream_tok_s is None:
        p.error("--objective capacity needs --min-stream-tok-s (the floor every stream must keep)")
    if ns.min_stream_tok_s is not None and ns.min_stream_tok_s <= 0:
        p.error("--min-stream-tok-s must be > 0")
    if not 0 <= ns.prune_below < 1:
        p.error("--prune-below must be in [0, 1): a share of the leader's short figure (0: off)")
    if ns.confirm_rounds < 0 or ns.confirm_top < 1:
        p.error("--confirm-rounds must be >= 0 and --confirm-top >= 1")
    slo = _slo(p, ns.slo)
    _check_traffic(p, ns)
    if ns.workload == BENCHMARK and slo:
        p.error("--slo needs a traffic workload, not --workload benchmark")
    if ns.objective == Objective.goodput.value and ns.workload in (None, BENCHMARK) and not slo:
        p.error("--objective goodput needs --workload (or, in place, --slo: the recorded traffic)")
    if ns.workload not in (None, BENCHMARK) and ns.objective in (Objective.aggregate.value, Objective.capacity.value):
        p.error(f"--objective {ns.objective} is the fixed benchmark's; on a --workload the objective is goodput")
    return SearchOptions(
        trials=ns.trials, where=ns.where or Where.auto, app_name=ns.app_name, ray_address=ns.ray_address,
        serve_address=ns.serve_address, model=ns.model, base_config=ns.base_config, space=ns.space,
        vram_budget=ns.vram_budget, ram_budget=ns.ram_budget, min_ctx_per_slot=ns.min_ctx_per_slot,
        device=DeviceChoice(ns.device),
        gen_tokens=ns.gen_tokens, repeats=ns.repeats, prompt_set=ns.prompt_set, min_stream_tok_s=ns.min_stream_tok_s,
        max_quality_loss=ns.max_quality_loss, workload=ns.workload, slo=slo, requests=ns.requests,
        concurrency=ns.concurrency, rate=ns.rate, rate_scale=ns.rate_scale, length_scale=ns.length_scale,
        objective_choice=Objective(ns.objective) if ns.objective else None,
        prefer_choice=Prefer(ns.prefer) if ns.prefer else None,
        confirm_rounds=ns.confirm_rounds, confirm_top=ns.confirm_top, sampler=Sampler(ns.sampler), seed=ns.seed,
        prune_below=ns.prune_below,
        storage=ns.storage, study_name=ns.study_name, results_dir=ns.results_dir, out=ns.out, apply=ns.apply)


def _slo(p: argparse.ArgumentParser, text: str | None) -> Slo | None:
    if text is None:
        return None
    try:
        return Slo.parse(text)
    except ValueError as exc:
        p.error(f"--slo: {exc}")


def _check_traffic(p: argparse.ArgumentParser, ns: argparse.Namespace) -> None:
    """The traffic flags make sense together (the workload file itself is read when the study starts)."""
    named = ns.workload in (None, LIVE, BENCHMARK, *(b.value for b in Builtin))
    if not named and not Path(ns.workload).is_file():
        p.error(f"--workload {ns.workload!r}: not live, {', '.join(b.value for b in Builtin)}, benchmark, or an "
                "existing file")
    if ns.requests is not None and ns.requests < 1:
        p.error("--requests must be at least 1")
    if ns.concurrency < 1:
        p.error("--concurrency must be at least 1")
    if (ns.rate is not None and not ns.rate > 0) or not ns.rate_scale > 0 or not ns.length_scale > 0:
        p.error("--rate, --rate-scale and --length-scale must be above 0")
    if ns.workload == LIVE and ns.where is Where.offline:
        p.error("--workload live replays the serving app's traffic: it needs the app (drop --offline)")
    if ns.slo and not ns.workload and ns.where is Where.offline:
        p.error("--slo offline needs --workload (chat, rag, agent or a FILE): the fixed benchmark has no latency "
                "targets")
