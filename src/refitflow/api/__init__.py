"""The user-facing pair: ``Publisher`` (a trainer rank announces each version of its shards) and
``Receiver`` (an inference rank refits its model to the newest complete version, transactionally).

Both sit on the pipeline (``refitflow.pipeline``), a transport (``refitflow.transports``) and a
registry (``refitflow.registry``); they may import any of those, never ``engine``, ``cli`` or
``integrations``, which build on them.
"""
