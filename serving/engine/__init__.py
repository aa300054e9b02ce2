"""The engine: llama.cpp bindings, the scheduler and the engine core. No HTTP, no Serve.

Import modules, not this package's names: importing a light module (`request`, `config`) must not load
libllama, so this file re-exports nothing.
"""
