"""Which weights produced which tokens: vLLM's weight-version spans, per token (plain data, no server: the
real server's spans are checked in test_vllm_no_drain.py)."""

from __future__ import annotations

import pytest

from refitflow.core.errors import ConfigError
from refitflow.integrations.vllm import VllmFleet, policy_mask, token_versions

SPANS = [{"version": "1", "start": 0, "end": 3}, {"version": "2", "start": 3, "end": 5}]


def test_every_token_gets_the_label_of_its_span_and_the_mask_keeps_the_wanted_policies() -> None:
    assert token_versions(SPANS, tokens=5) == ["1", "1", "1", "2", "2"]
    assert policy_mask(SPANS, {"2"}) == [False, False, False, True, True]
    assert policy_mask(SPANS, {1, 2}) == [True] * 5  # versions compare as vLLM's string labels
    assert token_versions([]) == []


@pytest.mark.parametrize(
    ("spans", "tokens", "why"),
    [
        ([{"version": "1", "start": 1, "end": 3}], None, "expected it to start at 0"),  # a gap
        (SPANS[::-1], None, "expected it to start at 0"),  # out of order
        ([{"version": "1", "start": 0}], None, "is not"),  # no end
        ([{"version": "1", "start": 0, "end": "x"}], None, "is not"),
        (SPANS, 4, "cover 5 tokens, the output has 4"),  # another output's spans
    ],
)
def test_spans_that_do_not_tile_the_output_are_refused(spans: list[dict[str, object]], tokens: int | None,
                                                        why: str) -> None:  # fmt: skip
    with pytest.raises(ValueError, match=why):
        token_versions(spans, tokens)


@pytest.mark.asyncio
async def test_a_no_drain_refit_needs_a_shadow_fleet() -> None:
    with pytest.raises(ConfigError, match="shadow"):
        await VllmFleet(["http://198.18.0.1:1"], mode="in_place").refit(1, no_drain=True)
