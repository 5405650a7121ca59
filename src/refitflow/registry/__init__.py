"""The registry: where publications are announced and discovered, split by the side each part runs on.

- ``protocol``: the registry's interface, one home — what a publisher (``Publishing``) and a receiver
  (``Discovery``, ``RelayRegistry``) ask of it, all of it (``RegistryProtocol``: ``rf.Registry`` and
  ``rf.RegistryClient``) and what the service serves (``Store``); ``implement``: protocol methods made from
  their signatures (a store's reads forwarded, a client's plain requests).
- ``service/``: what runs in the registry process: the ZMQ service (``server``, ``ops``, ``admission``) and its
  two stores: in memory (``store``, ``model``, ``leases``, ``checks``, ``relays``, ``near_misses``;
  ``embedded.Registry`` serves one in-process) and in etcd (``etcd/``: stateless replicas of one deployment).
- ``client/``: what runs in publishers and receivers: ``RegistryClient`` over one ``Channel`` per replica with
  fail-over (``replicas``), announcements, fetched manifests, what it keeps told (``upkeep``), ``connect_registry``.
- here, what both sides share: addresses (``address``), the wire messages (``messages``), CURVE keys
  (``security``), when a version is released (``release``) and the limits of a request (``limits``).

It imports only ``core``: the publisher and receiver use it, never the reverse.
"""
