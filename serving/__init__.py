"""Serving: a continuous-batching llama.cpp engine per GPU behind Ray Serve, OpenAI-compatible.

Modules that touch llama.cpp import it through `serving.llama`, which fixes the library load order.
"""
