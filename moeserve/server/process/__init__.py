"""The API server process(es): start-up, connections, shutdown (server/__init__.py)."""
