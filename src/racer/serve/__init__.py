"""The OpenAI-compatible HTTP server: racer's public API only, never the engine's insides.

``racer serve`` runs it over ``racer.BatchDecoder``. The folder's rule: it calls racer's public API only (``racer.BatchDecoder``,
``racer.load_model``, ``racer.encode_prompt``, ...), never the engine's insides;
``protocol`` is pure Python, ``worker`` the decoding thread, ``app`` the routes.
"""

from racer.serve.server import serve

__all__ = ["serve"]
