"""The user-facing pair: ``Publisher`` (a trainer rank announces each version of its shards) and
``Receiver`` (an inference rank refits its model to the newest complete version, transactionally), with what
integrations use of them: how a transport is chosen (``transport``), a publisher's digests (``digesting``),
DTensor shards published in place (``dtensor``).

Both sit on the refit (``refitflow.refit``), the planner (``refitflow.planner``), a transport
(``refitflow.transports``) and a registry (``refitflow.registry``); they may import any of those, never
``engine``, ``cli`` or ``integrations``, which build on them.
"""
