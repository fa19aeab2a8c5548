"""The OpenAI-compatible HTTP server: racer's public API only, never the engine's insides.

``racer serve`` runs it over ``racer.BatchDecoder``. The folder's rule: it calls racer's public API only (``racer.BatchDecoder``,
``racer.load_model``, ``racer.encode_prompt``, ...), never the engine's insides;
``protocol`` is pure Python, ``core`` the engine core (its own process), ``core_client`` the
API side's handle on it, ``events`` what they say to each other, ``app`` the routes.
"""

from racer.serve.server import serve

__all__ = ["serve"]
