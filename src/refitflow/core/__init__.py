"""The core: the data that crosses process boundaries (``types``, ``wire``), dtypes by name
and the one exception tree (``errors``). It imports nothing else of refitflow.
"""
