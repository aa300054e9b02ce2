"""The engine replica's side of in-place tuning: a study's trials run on the engine that serves, with the
weights it already holds, taking turns with client requests.

A trial takes the engine exclusively: clients that arrive while it runs wait (at most `max_waiting` of
them; more get a 503 with Retry-After), the requests already admitted finish first, then the context is
rebuilt with the trial's config and the tuner's measurement runs on it. The next client to take its turn
finds the serving config restored first, so a client is never answered by a trial's config (a smaller
context, other slots). Turns are first come, first served (an asyncio.Lock is FIFO): a trial waiting for
its turn is not starved by a stream of clients, nor a client by a study.

The study ends when the tuner publishes the pick (or the old config) through the ConfigChannel, which
every replica applies (`finish`). A tuner that vanishes (killed, its machine gone) leaves a lease: after
`lease_s` without a trial the replica goes back to its serving config by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from serving.engine.config import EngineConfig
from serving.engine.errors import EngineUnavailableError, Unavailable

if TYPE_CHECKING:  # only annotations here: importing this module loads no libllama (its tests use a fake engine)
    from serving.engine.core import Engine
    from serving.engine.request import RequestHandle, SamplingParams

log = logging.getLogger("serving")

IDLE_POLL_S = 0.05
DRAIN_TIMEOUT_S = 600.0  # admitted requests get this long to finish before a trial gives up its turn
Measure = Callable[["Engine"], Any]  # the tuner's measurement; what it returns is the tuner's business


ABANDONED = "the study ended (a config was published) while this trial measured: its measurement was stopped"


class TrialAbandoned(RuntimeError):
    """A published config ended the study while this trial measured."""


class LentEngine:
    """The engine as a trial's measurement uses it (from a worker thread): every call passes through, except
    that once the trial is abandoned its requests in flight are cancelled and new ones refused. A published
    config (the pick, or the restore after Ctrl-C) then gets the engine within about one measured round,
    not after the whole measurement, which on a loaded CPU can take minutes."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._handles: list[RequestHandle] = []
        self.abandoned = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def submit(self, prompt_tokens: list[int], params: SamplingParams) -> RequestHandle:
        return self.submit_choices(prompt_tokens, params, 1)[0]

    def submit_choices(self, prompt_tokens: list[int], params: SamplingParams, n: int) -> list[RequestHandle]:
        if self.abandoned:
            raise TrialAbandoned(ABANDONED)
        handles = self._engine.submit_choices(prompt_tokens, params, n)
        self._handles = [h for h in self._handles if not h.finished] + handles
        return handles

    def abandon(self) -> None:
        """Stop the measurement: cancel its requests (RequestHandle.cancel is the engine's cross-thread
        cancel) and refuse the next; a request submitted in the same instant runs to its end."""
        self.abandoned = True
        for handle in list(self._handles):
            handle.cancel()


@dataclass(frozen=True)
class TrialRun:
    """What a trial on this replica gives back: the measurement's own result, untouched, and the replica's
    figures around it."""

    measured: Any
    setup_s: float  # rebuilding the context with the trial's config
    held_s: float  # from taking the engine to giving it back: clients that came meanwhile waited up to this
    weight_loads: int  # this replica's, start-up included: a trial must not add one


@dataclass
class Study:
    """A study running on this replica: what it serves when not in a trial, and where the study is."""

    name: str
    serving: EngineConfig
    trials: int
    trial: int = 0  # trials this replica has started
    in_trial: bool = False
    last_activity: float = 0.0

    def status(self) -> str:
        where = f"trial {self.trial}/{self.trials}" if self.in_trial else f"{self.trial}/{self.trials} trials done"
        return f"tuning: {where} (study {self.name})"


class TrialHost:
    """Turns on one replica's engine, between client requests and a study's trials."""

    def __init__(self, engine: Callable[[], Engine], lock: asyncio.Lock, max_waiting: int,
                 lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._engine, self._lock, self._max_waiting = engine, lock, max_waiting
        self._lease_s, self._clock = lease_s, clock
        self.study: Study | None = None
        self._waiting = 0  # clients waiting for their turn
        self._passing = 0  # clients between their turn and their submit
        self._trials = 0  # trials running or waiting for their turn
        self._lent: LentEngine | None = None  # the engine as the measuring trial holds it

    # -- clients -------------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def client_turn(self) -> AsyncIterator[None]:
        """Around checking, preparing and submitting one client request. Without a study it only counts
        the request as passing (a first trial waits for it); with one, it waits out a running trial."""
        if self.study is None:
            self._passing += 1
            try:
                yield
            finally:
                self._passing -= 1
            return
        if self._waiting >= self._max_waiting:
            raise EngineUnavailableError(Unavailable.tuning, "the server is tuning itself and its queue is full; "
                                         "retry shortly", 5)
        self._waiting += 1
        try:
            async with self._lock:  # waits out a running trial
                await self._serve_again()
                self._passing += 1
        finally:
            self._waiting -= 1
        try:
            yield
        finally:
            self._passing -= 1

    async def _serve_again(self) -> None:
        """Under the lock: make sure the engine runs the serving config before a client uses it."""
        study = self.study
        engine = self._engine()
        if study is not None and engine.config != study.serving:
            await asyncio.to_thread(engine.reconfigure, study.serving)

    # -- trials --------------------------------------------------------------------------------------
    @property
    def busy_with_trials(self) -> bool:
        """A trial runs here or waits for its turn: new clients would wait (serving/replica/routing.py sends them
        elsewhere when it can)."""
        return self._trials > 0

    async def run_trial(self, study: str, trials: int, config: EngineConfig, measure: Measure) -> TrialRun:
        """The next trial of `study` (of `trials`) here: the engine to itself, rebuilt with `config`, measured."""
        self._trials += 1
        try:
            return await self._run_trial(study, trials, config, measure)
        finally:
            self._trials -= 1

    async def _run_trial(self, study: str, trials: int, config: EngineConfig, measure: Measure) -> TrialRun:
        async with self._lock:
            held = time.perf_counter()
            engine = self._engine()
            current = self.study
            if current is None or current.name != study:
                current = self.study = Study(study, current.serving if current else engine.config, trials)
            current.trial, current.trials = current.trial + 1, max(trials, current.trial + 1)
            current.in_trial, current.last_activity = True, self._clock()
            try:
                await self._idle(engine)
                t0 = time.perf_counter()
                await asyncio.to_thread(engine.reconfigure, config)
                setup_s = time.perf_counter() - t0
                self._lent = LentEngine(engine)
                result = await asyncio.to_thread(measure, cast("Engine", self._lent))
            finally:
                self._lent = None
                current.in_trial, current.last_activity = False, self._clock()
            held_s = time.perf_counter() - held
        return TrialRun(result, setup_s, held_s, engine.weight_loads)

    async def _idle(self, engine: Engine) -> None:
        """Wait until no client is between its turn and its submit and every admitted request has ended."""
        deadline = self._clock() + DRAIN_TIMEOUT_S
        while self._passing or engine.queue_depth or engine.snapshot().slots_busy:
            if self._clock() > deadline:
                raise TimeoutError(f"client requests did not finish within {DRAIN_TIMEOUT_S:.0f} s")
            await asyncio.sleep(IDLE_POLL_S)

    # -- the end -------------------------------------------------------------------------------------
    def abandon(self) -> None:
        """A config was published: the trial measuring now (if one is) stops, so the config is applied
        without waiting for the rest of its measurement."""
        if self._lent is not None:
            log.info("%s: a config was published; stopping the trial's measurement",
                     self.study.status() if self.study else "tuning")
            self._lent.abandon()

    def finish(self) -> None:
        """The study is over (a config was published and is being applied): clients need no turns."""
        if self.study is not None:
            log.info("%s: ended", self.study.status())
        self.study = None

    async def expire(self) -> None:
        """A study whose tuner went quiet for `lease_s` ends here: the serving config comes back."""
        study = self.study
        if study is None or study.in_trial or self._clock() - study.last_activity < self._lease_s:
            return
        async with self._lock:
            if self.study is study and not study.in_trial:
                log.warning("%s: no trial for %.0f s; going back to the serving config", study.status(),
                            self._lease_s)
                await self._serve_again()
                self.study = None

    def state(self) -> dict[str, Any] | None:
        """For /slots: where a running study is, or None."""
        study = self.study
        if study is None:
            return None
        return {"study": study.name, "trial": study.trial, "trials": study.trials, "in_trial": study.in_trial,
                "status": study.status(), "clients_waiting": self._waiting}
