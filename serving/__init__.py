"""Serving: a continuous-batching llama.cpp engine per GPU behind Ray Serve, OpenAI-compatible.

Four parts and the composition root (`serving/app.py`, `serve run serving.app:main`):
- `engine/`: the engine on llama.cpp; no HTTP, no Serve. Modules that touch llama.cpp import it through
  `serving.engine.llama`, which fixes the library load order.
- `openai/`: the OpenAI API over the engine's public modules (`core`, `config`, `request`, `errors`,
  `chat_template`, `traffic`).
- `front/`: what a request meets first, with no engine: the HTTP rules, the error JSON, the ingress, the relay.
- `replica/`: the engine replica on Serve: the server, the host of its engine, the control routes, trials,
  the config channel, routing, metrics and node facts.
"""
