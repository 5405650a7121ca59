"""The core: the data that crosses process boundaries (``types``, ``wire``, relay offers: ``fanout``), dtypes by
name, digests and hashing (``digests``, ``hashing``, ``columns``), worker-thread helpers (``threads``) and the one
exception tree (``errors``). It imports nothing else of refitflow.
"""
