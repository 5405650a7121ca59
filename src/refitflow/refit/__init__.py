"""The refit: one attempt on one rank, as stage tasks joined by bounded streams, with the resources they write
into. ``graph.run_pipeline`` runs discover → plan → allocate → pull → translate → apply → verify → commit
(``stages/``) over one ``attempt.Attempt`` (made by discover and plan, handed to every stage) and one ``work.Work``
per bucket; ``landing`` is the path a piece's bytes take (read, translate, write), ``hashes`` how verify hashes
them, ``convert`` what commit runs for quantised parameters, ``fanout/`` a rank's part in pipelined fan-out.
The resources: the destination and its held digests (``destination``, ``held``), the staging arena and its byte
budget (``arena``, ``budget``), device streams (``device``), the transaction ledger, coverage and fence
(``transaction``, ``coverage``, ``fence``, ``rank``), plans with their replay state (``plans``), the receiver's
options (``config``) and what a refit reports (``results``).
"""
