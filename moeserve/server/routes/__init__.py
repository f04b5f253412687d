"""The generation routes: POST /v1/completions and /v1/chat/completions (server/__init__.py)."""
