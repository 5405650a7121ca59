"""The stream's configuration: one frozen, keyword-only dataclass per side, validated with sentences."""

from __future__ import annotations

from dataclasses import dataclass

from refitflow.core.errors import ConfigError
from refitflow.refit.config import ReceiverConfig
from refitflow.refit.destination import ApplyMode

__all__ = ["StreamReceiverConfig", "StreamSenderConfig"]

MiB = 1 << 20


def _src(src: object) -> None:
    if not isinstance(src, int) or isinstance(src, bool) or src < 0:
        raise ConfigError(f"src must be the sender's group rank (a non-negative integer), got {src!r}")


@dataclass(frozen=True, kw_only=True)
class StreamSenderConfig:
    bucket_bytes: int = 128 * MiB  # the frozen rule's limit; a tensor larger than it travels alone
    src: int = 0  # the sender's rank in the stream group

    def __post_init__(self) -> None:
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1:
            raise ConfigError(f"bucket_bytes must be a positive number of bytes, got {self.bucket_bytes!r}")
        _src(self.src)


@dataclass(frozen=True, kw_only=True)
class StreamReceiverConfig:
    # the payload of one bucket is held in it (one at a time): at least the sender's bucket size and
    # its largest tensor; a header announcing more is refused before anything is allocated
    budget_bytes: int = ReceiverConfig.budget_bytes
    mode: ApplyMode = ApplyMode.IN_PLACE
    lossy_casts: bool = False
    src: int = 0  # the sender's rank in the stream group

    def __post_init__(self) -> None:
        # the pipeline's own checks of the fields it shares (budget, mode), with its sentences
        shared = ReceiverConfig(budget_bytes=self.budget_bytes, mode=self.mode, lossy_casts=self.lossy_casts)
        object.__setattr__(self, "mode", shared.mode)
        _src(self.src)
