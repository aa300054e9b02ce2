"""Models by name: `model=OWNER/REPO:QUANT` (llama-server's `-hf` form), `OWNER/REPO` (the quant llama-server
would pick) or `OWNER/REPO/FILE.gguf` (one exact file), brought into huggingface_hub's cache.

Two steps in two places, so that every node of a cluster serves the same bytes: `resolve` pins a name to one
commit and the files to load (once, where the app is built), and `fetch` brings exactly that commit's files
into this node's cache (in each replica, before it loads). A repository that moves on between the two changes
nothing: the replicas ask for the commit, never for `main`.

Which file a QUANT names follows llama-server (common/download.cpp): the quant tag in a file name, any case,
followed by `.` or `-` (so Q4_K_M takes `x-Q4_K_M.gguf` and the first part of `x-Q4_K_M-00001-of-00002.gguf`);
sidecars (mmproj, imatrix, draft heads) are never the model; no QUANT tries Q4_K_M, then Q8_0, then the first
model file. Unlike llama-server, a QUANT that two models answer to is an error naming them, never a silent
pick. A split GGUF is fetched whole and loaded from its first part, as llama.cpp loads splits.

Network settings are the hub's own variables, read when a model is resolved or fetched rather than when
huggingface_hub was imported: HF_ENDPOINT (a mirror), HF_TOKEN (private and gated repositories, read by the hub
itself), HF_HUB_OFFLINE (no network: the cache only), HF_HUB_CACHE (where the cache is). Without network, a
name resolves from what the cache holds. huggingface_hub is imported inside the functions that call it, so
importing the engine's config stays light.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

log = logging.getLogger("serving")

SEGMENT = r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}"  # an owner or a repository name as the hub allows them
REPO = re.compile(rf"{SEGMENT}/{SEGMENT}")
QUANT = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # a quant tag: Q4_K_M, IQ4_XS, UD-Q4_K_XL, F16, ...
COMMIT = re.compile(r"[0-9a-f]{40}")
GGUF = ".gguf"
SPLIT = re.compile(r"(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf", re.IGNORECASE)  # llama_split_path
SIDECARS = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")  # GGUFs that are not the model
DEFAULT_QUANTS = ("Q4_K_M", "Q8_0")  # what llama-server tries for a name without a quant
LISTING_TIMEOUT_S = 10.0  # the hub's own default for its metadata calls
TRUE = ("1", "on", "yes", "true")


class ModelStoreError(ValueError):
    """A model name that does not resolve to one model, or a model that could not be brought into the cache;
    the message says what to change."""


class HubModel(BaseModel):
    """A model named on the hub, and once resolved, the commit and the files that are the model (the first
    one is what llama.cpp loads: the model, or a split model's first part)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    repo: str
    quant: str | None = None  # the quant asked for, as written
    file: str | None = None  # the exact file asked for, as written
    revision: str | None = None  # the commit, once resolved
    files: tuple[str, ...] = ()  # the files to fetch, the one to load first, once resolved

    @field_validator("repo")
    @classmethod
    def _repo(cls, value: str) -> str:
        if not REPO.fullmatch(value) or "--" in value or ".." in value:
            raise ValueError(f"{value!r} is not a repository name: write OWNER/REPO, e.g. ggml-org/gemma-3-1b-it-GGUF")
        return value

    @field_validator("quant")
    @classmethod
    def _quant(cls, value: str | None) -> str | None:
        if value is not None and not QUANT.fullmatch(value):
            raise ValueError(f"{value!r} is not a quant tag: write one as in the file names, e.g. Q4_K_M")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> HubModel:
        if self.quant is not None and self.file is not None:
            raise ValueError("a model by name has a quant (OWNER/REPO:QUANT) or a file (OWNER/REPO/FILE.gguf), "
                             "not both")
        if self.revision is not None and (not COMMIT.fullmatch(self.revision) or not self.files):
            raise ValueError(f"{self}: a resolved model has a 40-hex commit and at least one file")
        return self

    def __str__(self) -> str:
        """The name as written, which is also the name it is served under (llama-server names -hf models so)."""
        if self.file is not None:
            return f"{self.repo}/{self.file}"
        return f"{self.repo}:{self.quant}" if self.quant else self.repo

    @property
    def resolved(self) -> bool:
        return self.revision is not None

    def local_path(self, settings: HubSettings | None = None) -> Path:
        """Where the file to load is in this node's cache once fetched (the hub's layout: a snapshot per
        commit), whether it is there yet or not."""
        commit = self.commit
        return (settings or HubSettings.from_env()).snapshot(self.repo, commit) / self.files[0]

    @property
    def commit(self) -> str:
        """The commit this model is pinned to; an unresolved model has none yet (an error that says where names
        are resolved)."""
        if self.revision is None:
            raise ModelStoreError(f"model {self} is not resolved to a commit yet: the app builder resolves names "
                                  "(serving/app.py), each replica fetches what it resolved")
        return self.revision


@dataclass(frozen=True)
class HubSettings:
    """Where the hub is and where its cache is, from the hub's variables as they are now."""

    endpoint: str
    cache_dir: Path
    offline: bool
    timeout_s: float = LISTING_TIMEOUT_S

    @classmethod
    def from_env(cls) -> HubSettings:
        """The variables as set now, else huggingface_hub's defaults (read when it was imported)."""
        from huggingface_hub import constants

        offline = os.environ.get("HF_HUB_OFFLINE")
        return cls(endpoint=(os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/"),
                   cache_dir=Path(os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE).expanduser(),
                   offline=offline.strip().lower() in TRUE if offline is not None else constants.HF_HUB_OFFLINE)

    def storage(self, repo: str) -> Path:
        """The repository's folder in the cache (models--OWNER--REPO)."""
        return self.cache_dir / ("models--" + repo.replace("/", "--"))

    def snapshot(self, repo: str, revision: str) -> Path:
        return self.storage(repo) / "snapshots" / revision


def parse_name(text: str) -> HubModel | None:
    """The model a `model` setting names on the hub, or None when it is a path: an existing file, anything
    starting with `/`, `.` or `~`, and `DIR/FILE.gguf`. A name: OWNER/REPO, OWNER/REPO:QUANT or
    OWNER/REPO/FILE.gguf (the file may sit in folders of the repository)."""
    text = text.strip()
    if not text or text[0] in "/.~" or "\\" in text or Path(text).exists():
        return None
    head, sep, quant = text.rpartition(":")
    if sep and "/" in head and "/" not in quant:
        return _named(text, repo=head, quant=quant)
    parts = text.split("/")
    if len(parts) == 2 and not text.lower().endswith(GGUF):
        return _named(text, repo=text)
    if len(parts) > 2 and text.lower().endswith(GGUF) and "" not in parts:
        return _named(text, repo="/".join(parts[:2]), file="/".join(parts[2:]))
    return None


def _named(text: str, **fields: Any) -> HubModel:
    try:
        return HubModel(**fields)
    except ValidationError as exc:
        reason = exc.errors()[0]["msg"].removeprefix("Value error, ")
        raise ModelStoreError(f"model {text!r}: {reason} (a model by name is OWNER/REPO:QUANT, OWNER/REPO or "
                              "OWNER/REPO/FILE.gguf; a file is a path to it)") from None


# -- which files a name means -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Split:
    """A split GGUF's part, as llama.cpp names them: PREFIX-00001-of-00003.gguf."""

    prefix: str
    index: int
    count: int

    @classmethod
    def of(cls, path: str) -> Split | None:
        match = SPLIT.fullmatch(path)
        if match is None:
            return None
        return cls(match["prefix"], int(match["index"]), int(match["count"]))


def is_model_file(path: str) -> bool:
    """A GGUF that holds a model, not a sidecar of one (a projector, an importance matrix, a draft head)."""
    name = PurePosixPath(path).name.lower()
    return name.endswith(GGUF) and not any(mark in name for mark in SIDECARS)


def pick_files(model: HubModel, listing: Sequence[str]) -> tuple[str, ...]:
    """The files of the model `model` names among a repository's `listing`: the file to load first, then a
    split model's other parts. Raises ModelStoreError listing the repository's GGUFs when none or several
    models match."""
    listing = sorted(listing)
    if model.file is not None:
        found = [path for path in listing if path.lower() == model.file.lower()]
        if not found:
            raise _choice_error(model, listing, f"no file {model.file!r}")
        return _whole(found[0], listing)
    firsts = [path for path in listing if is_model_file(path) and _is_first(path)]
    if model.quant is not None:
        return _whole(_one_with_quant(model, model.quant, firsts, listing), listing)
    for quant in DEFAULT_QUANTS:
        if tagged := _tagged(quant, firsts):
            return _whole(tagged[0], listing)
    if firsts:
        return _whole(firsts[0], listing)
    raise _choice_error(model, listing, "no model file")


def _is_first(path: str) -> bool:
    """A whole model, or the first part of a split one (the part llama.cpp loads)."""
    split = Split.of(path)
    return split is None or split.index == 1


def _tagged(quant: str, paths: Iterable[str]) -> list[str]:
    """Paths that carry the quant tag: as llama-server matches it (the tag, any case, then `.` or `-`), and not
    inside a longer tag (Q4_0 is not IQ4_0)."""
    pattern = re.compile(rf"(?<![A-Za-z0-9]){re.escape(quant)}[.-]", re.IGNORECASE)
    return [path for path in paths if pattern.search(path)]


def _one_with_quant(model: HubModel, quant: str, firsts: list[str], listing: list[str]) -> str:
    tagged = _tagged(quant, firsts)
    if len(tagged) == 1:
        return tagged[0]
    if not tagged:
        raise _choice_error(model, listing, f"no model file with the quant {quant}")
    raise _choice_error(model, listing, f"{len(tagged)} model files with the quant {quant} ({', '.join(tagged)}): "
                        f"name one as {model.repo}/FILE.gguf")


def _whole(first: str, listing: list[str]) -> tuple[str, ...]:
    """`first` with the other parts of its split, the first part first; every part must be there."""
    split = Split.of(first)
    if split is None or split.count == 1:
        return (first,)
    parts = {s.index: path for path in listing
             if (s := Split.of(path)) is not None and (s.prefix, s.count) == (split.prefix, split.count)}
    missing = [i for i in range(1, split.count + 1) if i not in parts]
    if missing:
        raise ModelStoreError(f"the split model {split.prefix} has {split.count} parts but the repository lacks "
                              f"part(s) {', '.join(map(str, missing))}")
    return tuple(parts[i] for i in range(1, split.count + 1))


def _choice_error(model: HubModel, listing: Sequence[str], what: str) -> ModelStoreError:
    return ModelStoreError(f"model {model}: {what} in {model.repo}; its GGUF files: {available(listing)}")


def available(listing: Sequence[str]) -> str:
    """The GGUF files of a listing for an error message, a split model once (its first part and its count)."""
    shown = []
    for path in sorted(listing):
        split = Split.of(path)
        if split is not None and split.count > 1:
            if split.index == 1:
                shown.append(f"{path} ({split.count} parts)")
        elif path.lower().endswith(GGUF):
            shown.append(path)
    return ", ".join(shown) or "none"


# -- resolve (where the app is built) and fetch (in each replica) ---------------------------------------------

def resolve(model: HubModel, settings: HubSettings | None = None) -> HubModel:
    """`model` pinned to the commit the hub's `main` is at and the files to load; from the cache when the hub
    cannot be reached (or HF_HUB_OFFLINE is set). A model already resolved is returned as it is."""
    if model.resolved:
        return model
    settings = settings or HubSettings.from_env()
    revision, listing = _listing(model, settings)
    pinned = model.model_copy(update={"revision": revision, "files": pick_files(model, listing)})
    log.info("model %s is %s at commit %s (%s)", model, pinned.files[0], revision, _parts(pinned))
    return pinned


def _parts(model: HubModel) -> str:
    return f"{len(model.files)} parts" if len(model.files) > 1 else "one file"


def _listing(model: HubModel, settings: HubSettings) -> tuple[str, list[str]]:
    """The commit of `main` and its files: the hub's answer, else the newest cached snapshot that holds the
    model (llama-server also falls back to its cache)."""
    if settings.offline:
        return _cached_listing(model, settings, "HF_HUB_OFFLINE is set")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    try:
        info = HfApi(endpoint=settings.endpoint).model_info(model.repo, timeout=settings.timeout_s)
    except GatedRepoError:
        raise ModelStoreError(f"model {model}: {model.repo} is gated: accept its terms on the hub, then set "
                              "HF_TOKEN to a token of that account") from None
    except RepositoryNotFoundError:
        raise ModelStoreError(f"model {model}: no repository {model.repo} on {settings.endpoint} (a private one "
                              "needs HF_TOKEN; a local file is written as a path, e.g. ./models/x.gguf)") from None
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status is not None and status < 500:
            raise ModelStoreError(f"model {model}: {settings.endpoint} answered {status}: {exc}") from None
        return _cached_listing(model, settings, f"{settings.endpoint} failed ({exc})")
    except Exception as exc:  # no connection, a timeout, a proxy: the cache may still have it
        return _cached_listing(model, settings, f"{settings.endpoint} could not be reached ({exc!r})")
    if not info.sha:
        raise ModelStoreError(f"model {model}: {settings.endpoint} gave no commit for {model.repo}")
    return info.sha, [sibling.rfilename for sibling in info.siblings or ()]


def _cached_listing(model: HubModel, settings: HubSettings, why: str) -> tuple[str, list[str]]:
    """The newest snapshot in the cache that holds the model `model` names (`main`'s first, as the cache
    records it), with the files it holds."""
    storage = settings.storage(model.repo)
    ref = storage / "refs" / "main"
    main = ref.read_text().strip() if ref.is_file() else None
    snapshots = sorted((p for p in (storage / "snapshots").glob("*") if p.is_dir()),
                       key=lambda p: (p.name != main, -p.stat().st_mtime))
    last: ModelStoreError | None = None
    for snapshot in snapshots:
        listing = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
        try:
            pick_files(model, listing)
        except ModelStoreError as exc:
            last = exc
            continue
        log.warning("model %s: %s; using the cached commit %s", model, why, snapshot.name)
        return snapshot.name, listing
    cached = f" (the cache has: {last})" if last is not None else ""
    raise ModelStoreError(f"model {model}: {why}, and {settings.cache_dir} does not hold it{cached}")


def fetch(model: HubModel, settings: HubSettings | None = None) -> Path:
    """Bring a resolved model's files into this node's cache (a file already there is not asked for again:
    no network) and return the path of the file to load. huggingface_hub shows a progress bar per file, and
    resumes a file whose connection broke from where it stopped."""
    settings = settings or HubSettings.from_env()
    snapshot = settings.snapshot(model.repo, model.commit)
    for index, name in enumerate(model.files, 1):
        if (snapshot / name).is_file():
            continue
        log.info("fetching %s of %s at %s (%d of %d) into %s", name, model.repo, model.commit[:12], index,
                 len(model.files), settings.cache_dir)
        _download(model, name, settings)
    return model.local_path(settings)


def _download(model: HubModel, name: str, settings: HubSettings) -> None:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        hf_hub_download(model.repo, name, revision=model.revision, cache_dir=settings.cache_dir,
                        endpoint=settings.endpoint, local_files_only=settings.offline,
                        etag_timeout=settings.timeout_s)
    except LocalEntryNotFoundError as exc:
        where = "HF_HUB_OFFLINE is set" if settings.offline else f"{settings.endpoint} could not be reached"
        raise ModelStoreError(f"model {model}: {name} is not in this node's cache ({settings.cache_dir}) and "
                              f"{where} ({exc})") from None
    except Exception as exc:
        raise ModelStoreError(f"model {model}: fetching {name} at commit {model.revision} from "
                              f"{settings.endpoint} failed: {type(exc).__name__}: {exc}") from exc
