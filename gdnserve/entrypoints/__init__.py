"""User-facing entry points: the ``gdnserve`` command line (``cli.py``); later the offline ``LLM``
API and the HTTP server."""
