"""The receiver's pipeline: the stage graph (``graph``), the byte budget and its staging arena,
the destination parameters and how each apply mode writes them, the device seam (refit streams
and events, ``device``), coverage, transactions, the fence, a receiving rank's state wired to its
observer (``rank``) and the receiver's configuration. It runs ``stages`` and imports ``layouts``,
``core`` and ``metrics``; the stages see it only through the Protocols in ``stages._context``.
"""
