"""A rank's part in pipelined fan-out (docs/fanout.md): ``relaying`` serves this rank's verified bytes to others
as a relay and binds the upstream relay it reads from; ``reading`` reads from that upstream. Fan-out's other
parts carry the same name: the offer's wire form (``core/fanout.py``), its read geometry
(``planner/fanout.py``) and the registry's scheduler (``registry/service/fanout.py``).
"""
