"""The registry: where publications are announced and discovered.

The embedded store (``store``, ``embedded.Registry``), the ZMQ service that serves it (``service``,
``ops``, ``admission``) within its ``limits``, the client that speaks to it (``client``, ``channel``),
the wire messages (``messages``), CURVE keys (``security``), when a version is released
(``release``), and the checks a manifest or a replica source must pass on arrival (``checks``,
``replicas``). It imports only ``core``: the
publisher and receiver use it, never the reverse.
"""
