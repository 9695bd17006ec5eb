"""An OpenAI-compatible HTTP server over the engine: `python -m qwen35_lib serve`.

`loop.EngineLoop` (one thread doing continuous batching across all open requests), `protocol` (the wire
format), `app.make_app` (the FastAPI routes), `cli` (the subcommand). Needs the `serve` extra (fastapi, uvicorn).
Nothing is imported here, so that `python -m qwen35_lib --help` stays light.
"""
