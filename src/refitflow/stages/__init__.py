"""The eight stages of a refit, one module each (discover, plan, allocate, pull, translate, apply,
verify, commit), and their helpers (``_segments``, ``_regions``, ``sources``, ``_reroute``,
``_fp8``, ``_filter``). Stages import ``transports``, ``layouts``, ``core`` and ``metrics``, and
see the pipeline only through the Protocols in ``_context``.
"""
