"""The engine core in its own process and the API processes' side of it: `protocol` (the
messages, msgspec over ZMQ), `core_proc` (the engine process's busy loop) and `async_client`
(an API process's handle on it)."""
