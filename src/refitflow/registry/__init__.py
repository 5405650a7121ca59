"""The registry: where publications are announced and discovered, split by the side each part runs on.

- ``service/``: what runs in the registry process: the ZMQ service (``server``, ``ops``, ``admission``), the
  store interface it serves (``store_api.Store``) and its two stores: in memory (``store``, ``model``,
  ``checks``, ``relays``, ``near_misses``; ``embedded.Registry`` serves one in-process) and in etcd (``etcd/``:
  stateless replicas of one deployment).
- ``client/``: what runs in publishers and receivers: ``RegistryClient`` over one ``Channel`` per replica with
  fail-over (``replicas``), announcements, fetched manifests, ``connect_registry``.
- here, what both sides share: addresses (``address``), the wire messages (``messages``), CURVE keys
  (``security``), when a version is released (``release``) and the limits of a request (``limits``).

It imports only ``core``: the publisher and receiver use it, never the reverse.
"""
