"""The push stream: receive (and send) the ATOM / LumenRL weight stream over a torch.distributed
group — header, metadata and payload broadcasts per bucket in a frozen wire format (``format``),
the group shared by trainer and inference ranks (``group``), the trainer-side ``StreamSender`` and
the inference-side ``StreamReceiver``, which feeds the refit's budget, transactions, coverage,
fence and metrics, and is driven by an ``EngineMember`` exactly as a pulling ``Receiver`` is.
"""
