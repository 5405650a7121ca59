"""The registry: where publications are announced and discovered.

The embedded store (``store``, ``embedded.Registry``), the ZMQ service that serves it (``service``,
``ops``, ``admission``) within its ``limits``, the client that speaks to it (``client``, ``channel``),
the wire messages (``messages``), CURVE keys (``security``), when a version is released
(``release``), the checks a manifest must pass on arrival (``checks``), and the relays of each
version with the scheduler that gives every reader an upstream (``relays``). It imports only ``core``: the
publisher and receiver use it, never the reverse.
"""
