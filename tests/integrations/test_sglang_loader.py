"""refitflow's SGLang loader, plugin guard, payload, place and driver on their own (no server process).

The payload test runs SGLang 0.5.23's own restricted unpickler (SGLang imported with its one stub,
``_sglang_stub``); the rest need no SGLang, and one test checks that the driver and the payload never
import it. SGLang must be installed (``.ci/engines-cpu.sh``): without it the payload test fails.
"""

from __future__ import annotations

import base64
import dataclasses
import pickle
import subprocess
import sys

import anyio
import pytest
import torch

from refitflow.core.errors import ConfigError, IntegrityError
from refitflow.integrations.hosting.info import RefitflowInitInfo, RefitflowUpdateInfo
from refitflow.integrations.sglang import loader, plugin
from refitflow.integrations.sglang.driver import SglangFleet
from refitflow.integrations.sglang.payload import KEY, LOADER, decode, encode
from refitflow.integrations.sglang.place import Place, receiver_layout
from tests.conftest import free_ports
from tests.integrations._sglang_stub import stub_torchvision

INIT = RefitflowInitInfo(registry="tcp://trainer:7100", model="m", identity={"layout": "megatron"}, mode="shadow")


def test_the_payload_passes_sglangs_restricted_unpickler_and_carries_the_init_and_the_version() -> None:
    """What a driver on another host sends: SGLang's tokenizer normalises it, each scheduler unpickles its
    rank's entry with SGLang's ``SafeUnpickler``; the tensor carries its own bytes (no shared memory)."""
    stub_torchvision()
    from sglang.srt.utils.common import MultiprocessingSerializer, normalize_serialized_named_tensor_payloads

    update = RefitflowUpdateInfo(version=12, timeout_s=30, wait_s=5)
    sent = encode(INIT, update, tp=4)
    assert len(sent) == 4 and all(isinstance(s, str) for s in sent)  # JSON: base64 strings
    for entry in normalize_serialized_named_tensor_payloads(sent):
        named = MultiprocessingSerializer.deserialize(entry)
        assert [n for n, _ in named] == [KEY]
        assert decode(named) == (INIT, update)


def test_anything_but_refitflows_payload_is_a_config_error_naming_what_came() -> None:
    good = torch.frombuffer(bytearray(b'{"init": {"registry": "tcp://h:1", "model": "m"}}'), dtype=torch.uint8)
    with pytest.raises(ConfigError, match=r"model\.embed_tokens\.weight"):
        decode([("model.embed_tokens.weight", torch.zeros(2))])
    with pytest.raises(ConfigError, match="uint8"):
        decode([(KEY, torch.zeros(2))])
    with pytest.raises(ConfigError, match="does not hold"):
        decode([(KEY, good.clone())])  # no update info
    with pytest.raises(ConfigError, match="does not hold"):
        decode([(KEY, torch.tensor(list(b"not json"), dtype=torch.uint8))])
    with pytest.raises(ConfigError, match="version"):  # the info classes check their fields
        decode(pickle.loads(pickle.dumps([(KEY, torch.tensor(list(b'{"init": {"registry": "tcp://h:1", "model": '
                                                                       b'"m"}, "update": {"version": -1}}'),
                                                              dtype=torch.uint8))])))  # fmt: skip
    with pytest.raises(ConfigError, match="tp"):
        encode(INIT, RefitflowUpdateInfo(version=1), tp=0)


def test_the_loader_refuses_to_run_outside_the_plugins_guard() -> None:
    """SGLang stops its scheduler on a loader's exception: without the plugin's guard a failed refit would take
    the server down, so the loader does not start one (this refusal is the one raise that can reach SGLang)."""
    with pytest.raises(ConfigError, match=r"sglang\.srt\.plugins"):
        loader.refit(torch.nn.Linear(2, 2), [])


def test_the_guard_answers_a_failed_refit_as_sglangs_false_and_leaves_other_formats_alone() -> None:
    seen = []

    def failing(self: object, *, named_tensors: list, load_format: str | None) -> tuple[bool, str]:
        seen.append(loader._guard.active)
        error = IntegrityError("pulled bytes do not match", version=3)
        error.add_note("version 3 not committed")
        raise error

    answer = plugin.guard(failing, object(), named_tensors=[], load_format=LOADER)
    assert answer[0] is False and answer[1].startswith("refitflow: IntegrityError: pulled bytes"), answer
    assert "version 3 not committed" in answer[1] and seen == [True] and not loader._guard.active
    with pytest.raises(IntegrityError):  # another load format: SGLang's own behaviour, untouched
        plugin.guard(failing, object(), named_tensors=[], load_format="direct")
    assert seen == [True, False]
    assert plugin.guard(lambda self, **kw: (True, "Success"), object(), named_tensors=[], load_format=LOADER) == (
        True, "Success")  # fmt: skip


def test_a_place_the_tables_do_not_model_is_refused_so_the_model_loads_through_load_weights() -> None:
    assert Place(tp=2, tp_rank=1, ep=2).parallel() is not None  # whole experts: modelled
    for place, what in [(Place(tp=4, tp_rank=0, ep=2), "expert parallelism"), (Place(tp=2, tp_rank=0, pp=2),
                        "pipeline"), (Place(tp=4, tp_rank=0, attn_tp=2), "attention-DP")]:  # fmt: skip
        with pytest.raises(ConfigError, match=what):
            place.parallel()
    with pytest.raises(ConfigError, match="config"):
        receiver_layout(torch.nn.Linear(2, 2), Place(tp=1, tp_rank=0))
    assert Place(tp=4, tp_rank=3, pp=2, pp_rank=1).rank == 7


@pytest.mark.asyncio
async def test_an_unreachable_server_is_a_failed_engine_naming_the_route_within_the_deadline() -> None:
    url = f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there
    fleet = SglangFleet({"gone": url}, INIT, tp=2, request_timeout_s=2)
    with anyio.fail_after(30):
        result = (await fleet.refit(1, timeout_s=5))["gone"]
    assert not result.committed and result.version is None
    assert "pause_generation: no answer" in (result.ranks[0].error or ""), result
    assert fleet.paused == set()  # it never began: nothing to fence
    with pytest.raises(ConfigError, match="pause_mode"):
        SglangFleet([url], INIT, pause_mode="sideways")
    with pytest.raises(ConfigError, match="TP size"):
        SglangFleet([url], INIT, tp=0)


def test_the_driver_and_the_payload_work_without_importing_sglang() -> None:
    """A trainer process drives SGLang servers without SGLang's import (seconds, and a GPU stack)."""
    code = (
        "import sys\n"
        "from refitflow.integrations.sglang import SglangFleet, encode, LOADER\n"
        "from refitflow.integrations.hosting.info import RefitflowInitInfo, RefitflowUpdateInfo\n"
        "encode(RefitflowInitInfo(registry='tcp://h:1', model='m'), RefitflowUpdateInfo(version=1), tp=2)\n"
        "print(sorted(m for m in sys.modules if m == 'sglang' or m.startswith('sglang.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_driver_spreads_its_servers_read_starts_unless_they_relay_or_were_given_one() -> None:
    """Each server's payload carries its own ``read_start`` (server i of n by name: i / n; the first's 0 is
    the caller's init as it was); a server added later starts at 0; relays and a caller's own ``read_start``
    are left as they are."""
    urls = {f"s{i}": f"http://127.0.0.1:{9000 + i}" for i in (2, 0, 1)}

    def start(fleet: SglangFleet, name: str) -> object:
        payload = fleet._body(name, 1, 10.0, None)["serialized_named_tensors"][0]
        init, _ = decode(pickle.loads(base64.b64decode(payload)))
        return init.receiver_options.get("read_start")

    fleet = SglangFleet(urls, INIT, tp=2)
    assert [start(fleet, n) for n in ("s0", "s1", "s2", "joiner")] == [None, 1 / 3, 2 / 3, None]
    relays = dataclasses.replace(INIT, receiver_options={"serve_replicas": True})
    assert {start(SglangFleet(urls, relays), n) for n in urls} == {None}
    own = dataclasses.replace(INIT, receiver_options={"read_start": 0.5})
    assert {start(SglangFleet(urls, own), n) for n in urls} == {0.5}
