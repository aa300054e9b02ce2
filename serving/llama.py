"""The one place that loads libllama, so the load order is safe wherever the engine runs.

Measured on the H200 machine (2026-12-02, CUDA build of llama.cpp 0c1e570): importing `ray` AFTER
libllama.so was loaded aborts the process ("free(): invalid pointer") when ray loads its _raylet.so with
RTLD_GLOBAL; ray first, then libllama, works. Loading a 152k-vocabulary model with numpy imported before
libllama (a crash reported in shared/device-notes.md) did not crash in the same session, inside a Ray task.
So this module imports ray before llama_cpp, every module of ours that needs llama.cpp imports it from
here. `numpy_was_first` is kept for diagnosis.
"""

from __future__ import annotations

import ctypes
import logging
import sys

numpy_was_first = "numpy" in sys.modules

import ray  # noqa: E402,F401  (ray's _raylet.so must load before libllama: see above)
import llama_cpp.llama_cpp as llama_cpp  # noqa: E402

_log = logging.getLogger("llama.cpp")

# ggml_log_level: 1 debug, 2 info, 3 warn, 4 error, 5 continuation of the previous line
_LEVELS = {1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}


@llama_cpp.llama_log_callback
def _route_log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    """Send llama.cpp's log lines to Python logging (its INFO chatter becomes DEBUG)."""
    py_level = _LEVELS.get(level, logging.DEBUG)
    if py_level == logging.INFO:
        py_level = logging.DEBUG
    if _log.isEnabledFor(py_level):
        _log.log(py_level, text.decode("utf-8", "replace").rstrip())


llama_cpp.llama_log_set(_route_log, ctypes.c_void_p())
llama_cpp.llama_backend_init()

__all__ = ["llama_cpp", "numpy_was_first"]
