"""`llama-serve-tune serve|tune|bench ...`: the project's commands under one name, each exactly the command it
stands for, so their docs and flags stay theirs.

- `serve [KEY=VALUE ...]` is `serve run serving.app:main [KEY=VALUE ...]` (Serve's own `serve run`; its options,
  e.g. `--address`, pass through too, and `serve --help` is `serve run --help`);
- `tune [ARGS ...]` is `python -m tuning.search [ARGS ...]`;
- `bench` lists the scripts of scripts/ (a benchmark `bench_NAME.py` by NAME), `bench NAME [--] [ARGS ...]` is
  `python scripts/bench_NAME.py [ARGS ...]` (or scripts/NAME.py);
- `--version` names this package's version and those of llama-cpp-python (its llama.cpp) and Ray.

The process becomes the command (exec), so Ctrl-C, exit codes and output are the command's own. Nothing here
imports Ray or llama.cpp: `--version` and `bench` answer at once.
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

PACKAGE = "llama-serve-tune"
REPORTED = (PACKAGE, "llama-cpp-python", "ray")  # what --version names
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"  # in a source checkout (pip install -e .)
BENCH_PREFIX = "bench_"
APP = "serving.app:main"


class Subcommand(str, Enum):
    """What the console command runs."""

    serve = "serve"
    tune = "tune"
    bench = "bench"


@dataclass(frozen=True)
class Launch:
    """A command line for the process to become: argv[0] is the program."""

    argv: tuple[str, ...]


Launcher = Callable[[Launch], int]


def execute(launch: Launch) -> int:
    """Become the command (never returns): its signals, output and exit status are the user's directly."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(launch.argv[0], list(launch.argv))


def main(argv: Sequence[str] | None = None, launch: Launcher = execute) -> int:
    """The console entry point: parse, then launch the command the subcommand stands for (bench with no name
    lists the scripts instead). Returns the exit status where nothing was launched; argparse exits 2 on a
    wrong word."""
    parser = _parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    command = Subcommand(args.command)
    if command is Subcommand.bench and args.args[:1] in ([], ["-h"], ["--help"]):
        print(_listing(SCRIPTS))
        return 0
    try:
        return launch(_launch(command, list(args.args), SCRIPTS))
    except LookupError as exc:
        parser.error(str(exc))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llama-serve-tune", description="Serve GGUF models with llama.cpp behind Ray Serve, and tune them.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n"
               f"  serve [KEY=VALUE ...]      serve run {APP} [KEY=VALUE ...] (engine and server settings)\n"
               "  tune [ARGS ...]            python -m tuning.search [ARGS ...] (tune --help says which)\n"
               "  bench [--help]             list the benchmark scripts\n"
               "  bench NAME [--] [ARGS ...] run scripts/bench_NAME.py (or scripts/NAME.py) with ARGS\n\n"
               "example: llama-serve-tune serve model=/models/m.gguf n_parallel=2 chat_template=gemma")
    parser.add_argument("--version", action="version", version=version_line())
    parser.add_argument("command", choices=[c.value for c in Subcommand], help="what to run (below)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="passed on to the command")
    return parser


def _launch(command: Subcommand, args: list[str], scripts: Path) -> Launch:
    """The command line a subcommand stands for; LookupError for a bench script that is not there."""
    python = sys.executable
    if command is Subcommand.serve:
        return Launch((python, "-m", "ray.serve.scripts", "run", APP, *args))
    if command is Subcommand.tune:
        return Launch((python, "-m", "tuning.search", *args))
    name, rest = args[0], args[1:]
    return Launch((python, str(_script(name, scripts)), *(rest[1:] if rest[:1] == ["--"] else rest)))


def _script(name: str, scripts: Path) -> Path:
    """scripts/bench_NAME.py, else scripts/NAME.py, for a NAME `bench` lists; LookupError listing them otherwise."""
    if not scripts.is_dir():
        raise LookupError(f"bench: no scripts/ beside the package ({scripts}); the scripts are in the source "
                          "checkout: pip install -e . there")
    if name not in _names(scripts):
        raise LookupError(f"bench: no script {name!r}; the scripts are: {', '.join(_names(scripts))}")
    bench = scripts / f"{BENCH_PREFIX}{name}.py"
    return bench if bench.is_file() else scripts / f"{name}.py"


def _names(scripts: Path) -> list[str]:
    """Each script's name for `bench NAME`: a benchmark without its prefix, any other by its stem."""
    return [_name(path) for path in _paths(scripts)]


def _paths(scripts: Path) -> list[Path]:
    return sorted((path for path in scripts.glob("*.py") if not path.stem.startswith("_")), key=_name)


def _name(path: Path) -> str:
    return path.stem.removeprefix(BENCH_PREFIX)


def _listing(scripts: Path) -> str:
    """`bench` alone: each script's name and the first line of its docstring (what it measures)."""
    if not scripts.is_dir():
        return f"no scripts/ beside the package ({scripts}): the scripts are in the source checkout"
    rows = [f"  {_name(path):<24} {_summary(path)}" for path in _paths(scripts)]
    return "\n".join(["scripts (llama-serve-tune bench NAME [--] [ARGS ...]; NAME --help for a script's own):", *rows])


def _summary(path: Path) -> str:
    """The first line of a script's docstring."""
    doc = (ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "").strip()
    return doc.splitlines()[0] if doc else ""


def version_line() -> str:
    """`llama-serve-tune 0.1.0 (llama-cpp-python 0.3.36, ray 2.52.1)`: what a bug report needs, read from the
    installed packages' metadata (nothing imported)."""
    found = [f"{name} {_version(name)}" for name in REPORTED]
    return f"{found[0]} ({', '.join(found[1:])})"


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
