"""The OpenAI-compatible HTTP server (its own process; the engine runs in another).

    launch.py            `moeserve serve`: flags, engine start-up, uvicorn (uvloop)
    app.py               build_app: routes, API key, errors, lifespan
    serve_completions.py POST /v1/completions
    serve_chat.py        POST /v1/chat/completions
    serving.py           what both share: parsing, sampling params, stream/collect, usage
    generation.py        one HTTP request's engine requests, disconnects, SSE
    protocol.py          pydantic models of the OpenAI protocol
    errors.py            OpenAI-style error JSON
    metrics.py           Prometheus metrics
"""
