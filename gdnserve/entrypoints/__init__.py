"""User-facing entry points of one engine: the commands (serve.py, generate.py, score.py), the offline ``LLM``
API and the HTTP server. The ``gdnserve`` command line that dispatches to them (and to ``replicas/`` for
``serve --replicas N``) is ``gdnserve/cli.py``, above both."""
