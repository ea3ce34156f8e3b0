"""gdnserve replicas on Ray Serve: ``app.py`` (the application: ingress + engine deployment), ``router.py``
(checkpoint-affinity request router), ``engine_replica.py`` (one engine per replica), ``client.py`` (the
ingress's engine client over the deployment handle), ``keys.py`` (the checkpoint a request needs),
``metrics.py`` (per-replica series), ``serve_cli.py`` (``gdnserve serve --replicas N``). Needs ``ray[serve]``."""
