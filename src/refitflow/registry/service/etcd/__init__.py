"""The registry's state in etcd (``store.EtcdStore``), over etcd's v3 gRPC API (``kv``), laid out per ``keys``."""
