"""The OpenAI API over the engine: request shapes (`requests`), the routes as an app factory (`routes`),
answers, tools, structured output, reasoning and slot files. Uses the engine's public modules only."""
