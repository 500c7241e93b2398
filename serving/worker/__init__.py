"""The workers' runtime, shared by prefill_service/ and decode_service/: a worker's front
process (worker.py) and its token streams, its engine-core process (engine_core.py), the
front's client of the core and the wire between them, the workers' configuration. The router
never imports it (pyproject.toml's import-linter contracts)."""
