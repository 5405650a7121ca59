"""Inside vLLM's API server and engine core: the plug-in entry points (``plugin``: registers the backend;
``endpoints``: the readiness route, a joining server's catch-up, ``join``, and the minimum-version contract,
``min_version``), the serving gate (``gate``), no-drain updates swapped in between two steps (``nodrain``), and
calls from the engine core to its workers (``workers``).
"""
