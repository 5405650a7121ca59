"""The engine: the ranks of one inference engine commit a version together or not at all.

The vote's rule and its channels (``vote``: ballots, ``decide``; ``gloo_vote``, ``zmq_vote``, and
``solo_vote`` for an engine of one rank), an ``EngineMember`` that wraps a ``Receiver`` around the
vote (``member``), the rank-side agent a controller talks to (``agent``), and the RL loop's
``Controller`` (``controller``). It builds on ``api`` (the receiver) and ``pipeline`` (its
transactions); nothing below it imports it.
"""
