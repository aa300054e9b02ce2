"""The engine replica on Ray Serve: the server (composes the OpenAI and control routes), the host of its
engine (engine-level errors, no HTTP), trials, the config channel, routing, metrics and node facts."""
