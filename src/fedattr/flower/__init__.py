"""fedattr on Flower: every client a Flower SuperNode, every SA query a Flower message.

Install with ``pip install 'fedattr[flower]'`` (``flwr==1.41.0``, Python >= 3.11). The
:data:`~fedattr.flower.server_app.app` ServerApp runs fedattr's round engine with a client pool
whose clients are SuperNodes (:mod:`~fedattr.flower.pool`) and pairwise-mask secure aggregation
whose parties are those clients (:class:`~fedattr.secagg.remote_server.RemoteMaskingServer`); the
:data:`~fedattr.flower.client_app.app` ClientApp trains locally, keeps its update in the node's
state and answers each round's SA queries in one message. ``fedattr flower`` runs a whole
federation on loopback processes (:mod:`~fedattr.flower.launch`).

Only this package imports ``flwr``; the rest of fedattr runs without it.
"""

from __future__ import annotations

COMMANDS = ("run", "demo")
"""What a Flower run runs: an LLM federation (``fedattr run``) or the synthetic one
(``fedattr demo-protocol``)."""
