"""Serving: a continuous-batching llama.cpp engine per GPU behind Ray Serve, OpenAI-compatible.

`serving.llama` is imported first so libllama.so is loaded before numpy (see that module).
"""

from serving import llama as _llama  # noqa: F401  (load order: libllama before numpy)
