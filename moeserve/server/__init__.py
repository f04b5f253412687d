"""The OpenAI-compatible HTTP server (its own process; the engine runs in another).

    app.py               build_app: routes, API key, errors, health, lifespan
    protocol.py          pydantic models of the OpenAI protocol (requests and responses)
    openapi.py           the document at /openapi.json and /docs
    errors.py            OpenAI-style error JSON
    metrics.py           Prometheus metrics
    routes/              the generation routes
        completions.py       POST /v1/completions
        chat.py              POST /v1/chat/completions
        serving.py           what both share: parsing, sampling params, stream/collect, usage
        request_limits.py    what a request may cost before it is tokenized
        generation.py        one HTTP request's engine requests, disconnects, SSE
    process/             the API server process(es)
        launch.py            `moeserve serve`: flags, engine start-up, uvicorn (uvloop), exit codes
        connections.py       uvicorn's HTTP protocol with request deadlines and a connection cap
        multiproc.py         `--api-servers N`: the launcher of N API processes
"""
