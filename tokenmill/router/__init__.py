"""`tokenmill router`: one OpenAI-compatible front over several `tokenmill serve` replicas.

    prefix.py    which prompt prefixes each replica has seen (chained hashes of text chunks)
    replicas.py  each replica's health, load and prefixes; the loop that polls /health and /metrics
    policy.py    which replica takes a request: cache_aware, round_robin, least_loaded
    forward.py   sending a request to a replica, retried on another before its first byte
    metrics.py   the router's own Prometheus figures
    app.py       the FastAPI app and its handlers
    launch.py    the command line and uvicorn

The router loads no model and no tokenizer: neither these modules nor `serve`'s socket and Host
helpers they borrow (server/options.py) import torch or transformers.
"""
