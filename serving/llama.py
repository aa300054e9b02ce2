"""The one place that loads libllama, so the load order is safe wherever the engine runs.

On the GPU machine a model with a large vocabulary crashed at load when numpy had been imported before
libllama.so (shared/device-notes.md). Importing `llama_cpp` loads the shared library first and numpy after
it, so every module of ours that needs llama.cpp imports it from here, and `serving/__init__.py` imports
this module before anything else of ours can pull numpy in. `numpy_was_first` records whether some other
code (a Ray worker, say) imported numpy earlier, and the engine logs it next to any load failure.
"""

from __future__ import annotations

import ctypes
import logging
import sys

numpy_was_first = "numpy" in sys.modules

import llama_cpp.llama_cpp as llama_cpp  # noqa: E402  (the load order is the point of this module)

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
