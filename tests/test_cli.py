"""The `llama-serve-tune` console command: each subcommand becomes the command line it stands for (checked by
calling main() with a launcher that records instead of exec'ing, so no Ray starts), and the installed command
answers --version and lists the scripts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from llama_serve_tune.cli import SCRIPTS, Launch, main

PYTHON = sys.executable
COMMAND = Path(PYTHON).parent / "llama-serve-tune"  # the console script pip installs beside the interpreter


def _launched(*argv: str) -> tuple[str, ...]:
    seen: list[Launch] = []
    assert main(list(argv), launch=lambda launch: seen.append(launch) or 0) == 0
    assert len(seen) == 1
    return seen[0].argv


@pytest.mark.unit
def test_serve_is_serve_run_of_the_app_with_the_words_passed_on() -> None:
    assert _launched("serve", "model=/m/gemma.gguf", "chat_template=gemma", "n_parallel=2") == (
        PYTHON, "-m", "ray.serve.scripts", "run", "serving.app:main", "model=/m/gemma.gguf", "chat_template=gemma",
        "n_parallel=2")
    assert _launched("serve", "--address", "auto", "config=configs/default.yaml")[3:] == (
        "run", "serving.app:main", "--address", "auto", "config=configs/default.yaml")  # serve run's own options
    assert _launched("serve", "--help")[3:] == ("run", "serving.app:main", "--help")


@pytest.mark.unit
def test_tune_is_the_search_module_with_its_arguments() -> None:
    assert _launched("tune", "--trials", "40", "--offline") == (PYTHON, "-m", "tuning.search", "--trials", "40",
                                                                 "--offline")
    assert _launched("tune") == (PYTHON, "-m", "tuning.search")


@pytest.mark.unit
def test_bench_runs_a_script_by_its_short_name() -> None:
    assert _launched("bench", "http_path", "--", "--help") == (PYTHON, str(SCRIPTS / "bench_http_path.py"), "--help")
    assert _launched("bench", "http_path", "--runs", "2") == (PYTHON, str(SCRIPTS / "bench_http_path.py"), "--runs",
                                                              "2")
    assert _launched("bench", "soak") == (PYTHON, str(SCRIPTS / "soak.py"))  # a script that is no benchmark


@pytest.mark.unit
@pytest.mark.parametrize("listing", [[], ["--help"]])
def test_bench_alone_lists_the_scripts_with_what_each_does(listing: list[str],
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", *listing], launch=lambda launch: pytest.fail(f"launched {launch}")) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines()[1:]}
    assert {"http_path", "constrained", "soak"} <= set(lines) and "bench_http_path" not in lines
    assert "HTTP path" in lines["http_path"]  # the first line of the script's docstring


@pytest.mark.unit
@pytest.mark.parametrize("argv,why", [
    (["bench", "nope"], "no script 'nope'; the scripts are: "),
    (["bench", "../tests/conftest"], "no script '../tests/conftest'"),  # only what scripts/ holds
    (["deploy"], "invalid choice: 'deploy'"),
    ([], "the following arguments are required: command"),
])
def test_a_wrong_word_is_a_usage_error_saying_why(argv: list[str], why: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(argv, launch=lambda launch: pytest.fail(f"launched {launch}"))
    assert exit_.value.code == 2 and why in capsys.readouterr().err


@pytest.mark.unit
def test_version_names_the_package_llama_cpp_python_and_ray(capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.metadata

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == (
        f"llama-serve-tune {importlib.metadata.version('llama-serve-tune')} (llama-cpp-python "
        f"{importlib.metadata.version('llama-cpp-python')}, ray {importlib.metadata.version('ray')})")


@pytest.mark.unit
def test_the_process_becomes_the_command_with_its_exit_status() -> None:
    """execute() exec's: what the command prints and its exit status are the console command's own."""
    code = ("import sys; from llama_serve_tune.cli import Launch, execute; "
            "execute(Launch((sys.executable, '-c', 'print(\"from the command\"); raise SystemExit(7)')))")
    done = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (7, "from the command\n")


@pytest.mark.unit
def test_the_installed_command_answers() -> None:
    """pyproject's [project.scripts] entry, as pip installed it: --version, and a script's own --help through
    bench (a script that imports neither Ray nor llama.cpp to say it)."""
    version = subprocess.run([str(COMMAND), "--version"], capture_output=True, text=True, timeout=60, check=True)
    assert version.stdout.startswith("llama-serve-tune ")
    helped = subprocess.run([str(COMMAND), "bench", "make_synthetic_gguf", "--", "--help"], capture_output=True,
                            text=True, timeout=60, check=True)
    assert helped.stdout.startswith("usage: make_synthetic_gguf.py")


@pytest.mark.engine  # imports Ray's libraries (in a child process), starts nothing
def test_serve_help_is_serve_runs() -> None:
    helped = subprocess.run([str(COMMAND), "serve", "--help"], capture_output=True, text=True, timeout=120,
                            check=True)
    assert "run [OPTIONS] CONFIG_OR_IMPORT_PATH" in helped.stdout


@pytest.mark.unit
def test_the_command_imports_none_of_the_projects_packages() -> None:
    """It exec's them instead (docs/layout.md): loading them would load Ray or llama.cpp for a --version."""
    import ast

    package = Path(__file__).resolve().parents[1] / "llama_serve_tune"
    imported = set()
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
    assert imported and not imported & {"serving", "tuning", "measure", "ray", "llama_cpp"}, sorted(imported)
