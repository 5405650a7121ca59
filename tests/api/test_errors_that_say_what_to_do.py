"""A newcomer's mistakes get typed errors that name the fix: transports, addresses, arguments, timeouts."""

from __future__ import annotations

import subprocess
import sys

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.registry.client.client import RegistryClient


@pytest.mark.asyncio
async def test_auto_transport_is_loopback_with_an_embedded_registry(ident, registry) -> None:
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver({"w": torch.zeros(4)}, registry, identity=ident) as recv,
        ):
            assert pub.transport.name == "loopback"
            await pub.publish(1, {"w": torch.ones(4)})
            assert (await recv.refit(1)).version == 1


@pytest.mark.asyncio
async def test_loopback_with_a_registry_service_is_refused_naming_the_fix(ident) -> None:
    client = RegistryClient("tcp://127.0.0.1:7100")  # never used: the refusal comes first
    try:
        for registry in ("tcp://127.0.0.1:7100", "ipc:///tmp/refitflow-registry", client):
            refused = r"reaches only this process.*transport='nixl'.*rf\.Registry object"
            with pytest.raises(rf.ConfigError, match=refused):
                rf.Publisher(registry, identity=ident, transport="loopback")
            with pytest.raises(rf.ConfigError, match=r"transport='nixl'"):
                rf.Receiver({"w": torch.zeros(2)}, registry, identity=ident, transport="loopback")
    finally:
        await client.aclose()


def test_auto_transport_without_nixl_names_the_extra_to_install() -> None:
    # nixl is installed here: the child blocks its import to stand for a machine without it
    code = (
        "import sys; sys.modules['nixl'] = None\n"
        "import refitflow as rf\n"
        "try:\n"
        "    rf.Publisher('tcp://127.0.0.1:7100', identity=rf.Identity(model='m'))\n"
        "except rf.ConfigError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'refitflow[nixl]'" in out.stdout and "tcp://127.0.0.1:7100" in out.stdout


@pytest.mark.asyncio
async def test_an_address_without_a_scheme_is_a_config_error_with_a_guess(ident) -> None:
    with pytest.raises(rf.ConfigError, match=r"has no scheme.*did you mean 'tcp://127\.0\.0\.1:7100'"):
        rf.Receiver({"w": torch.zeros(2)}, "127.0.0.1:7100", identity=ident)
    with pytest.raises(rf.ConfigError, match="has no scheme"):
        RegistryClient("localhost:7100")
    with pytest.raises(rf.ConfigError, match="has no scheme"):
        async with rf.Registry.serve("127.0.0.1:7100"):
            pass
    with pytest.raises(rf.ConfigError, match="'http' is not one of"):
        rf.Publisher("http://127.0.0.1:7100", identity=ident)


@pytest.mark.parametrize(
    "address", ["tcp://127.0.0.1", "tcp://127.0.0.1:notaport", "tcp://127.0.0.1:99999", "tcp://:7"]
)
@pytest.mark.asyncio
async def test_a_tcp_address_without_a_usable_port_is_a_config_error_where_it_is_given(ident, address) -> None:
    """Not at the first request, seconds later: where the address comes in, with an example."""
    with pytest.raises(rf.ConfigError, match=r"needs a port from 1 to 65535.*'tcp://127\.0\.0\.1:7100'"):
        RegistryClient(address)
    with pytest.raises(rf.ConfigError, match="needs a port"):
        rf.Receiver({"w": torch.zeros(2)}, address, identity=ident)
    with pytest.raises(rf.ConfigError, match="needs a port"):
        async with rf.Registry.serve(address):
            pass


def test_wrong_argument_types_are_config_errors(ident, registry) -> None:
    with pytest.raises(rf.ConfigError, match=r"torch\.nn\.Module or a mapping.*got list; name the tensors"):
        rf.Receiver([torch.zeros(2)], registry, identity=ident)
    with pytest.raises(rf.ConfigError, match=r"registry must be an rf\.Registry.*got int"):
        rf.Receiver({"w": torch.zeros(2)}, 7100, identity=ident)  # type: ignore[arg-type]
    with pytest.raises(rf.ConfigError, match=r"identity must be an rf\.Identity, got str"):
        rf.Publisher(registry, identity="tiny")  # type: ignore[arg-type]
    with pytest.raises(rf.ConfigError, match="transport must be"):
        rf.Publisher(registry, identity=ident, transport=None)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_a_value_that_is_not_a_tensor_is_refused_before_anything_is_announced(ident, registry) -> None:
    async with rf.Publisher(registry, identity=ident) as pub:
        with pytest.raises(rf.ConfigError, match="got NoneType"):
            await pub.publish(1, {"w": torch.zeros(2), "oops": None})  # type: ignore[dict-item]
        assert not pub.published and registry.newest_complete(ident) is None


@pytest.mark.asyncio
async def test_republishing_a_version_from_the_same_publisher_is_a_version_error(ident, registry) -> None:
    async with rf.Publisher(registry, identity=ident) as pub:
        await pub.publish(2, {"w": torch.ones(2)})
        for version in (2, 1):
            with pytest.raises(rf.VersionError, match="already published version 2; publish a greater version"):
                await pub.publish(version, {"w": torch.ones(2)})
        with pytest.raises(rf.ConfigError, match="mapping of names to tensors"):
            await pub.publish(3, [torch.ones(2)])  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_bytes_changed_after_publish_fail_integrity_with_a_hint_at_released(ident, registry) -> None:
    trainer = {"w": torch.randn(64, 64)}
    server = {"w": torch.zeros(64, 64)}
    with anyio.fail_after(20):
        async with (
            rf.Publisher(registry, identity=ident) as pub,
            rf.Receiver(server, registry, identity=ident, mode="shadow") as recv,
        ):
            await pub.publish(1, trainer)
            trainer["w"].add_(1.0)  # the next step, without waiting for released(1)
            with pytest.raises(rf.IntegrityError, match=r"released\(version\)") as err:
                await recv.refit(1)
            assert err.value.version == 1 and err.value.tensor == "w"
            assert torch.equal(server["w"], torch.zeros(64, 64))


async def _near_miss_setup(registry, ident: rf.Identity) -> list[rf.Publisher]:
    """Rank 0 of 2 publishes version 3; the same model under the Megatron layout is complete at 2."""
    other = rf.Identity(model=ident.model, layout="megatron")
    pubs = [rf.Publisher(registry, identity=ident, rank=0, world_size=2),
            rf.Publisher(registry, identity=other, rank=0, world_size=1)]  # fmt: skip
    for pub in pubs:
        await pub.__aenter__()
    await pubs[0].publish(3, {"w": rf.Sharded(tensor=torch.ones(2, 4), axis=0, start=0, global_shape=(4, 4))})
    await pubs[1].publish(2, {"w": torch.ones(4, 4)})
    return pubs


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["embedded", "service"])
async def test_discovery_timeout_names_the_identity_and_the_near_misses(ident, where: str) -> None:
    with anyio.fail_after(60):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server:
            pubs = await _near_miss_setup(server.registry, ident)
            registry = server.registry if where == "embedded" else server.address
            try:
                async with rf.Receiver({"w": torch.zeros(4, 4)}, registry, identity=ident) as recv:
                    with pytest.raises(rf.RefitTimeoutError) as err:
                        await recv.refit(3, timeout=0.5)
            finally:
                for pub in pubs:
                    await pub.__aexit__(None, None, None)
    text = str(err.value)
    assert "no complete version ≥ 3" in text and repr(ident) in text
    assert "1 of 2 ranks published version 3 (missing [1])" in text
    assert "with layout='megatron' (not 'hf'): version 2 is complete" in text


@pytest.mark.asyncio
async def test_near_misses_of_an_unknown_model_list_the_models_held(ident, registry) -> None:
    async with rf.Publisher(registry, identity=rf.Identity(model="tiny-mpl")) as pub:
        await pub.publish(1, {"w": torch.ones(2)})
        held = await registry.near_misses(ident, 1)
    assert held == ["nothing published for model 'tiny-mlp' (models held: 'tiny-mpl')"]


@pytest.mark.asyncio
@pytest.mark.parametrize("curve", [False, True])
async def test_a_registry_that_does_not_answer_hints_at_the_address_and_curve_keys(tmp_path, ident, curve) -> None:
    security = None
    if curve:
        from zmq.auth import create_certificates

        create_certificates(str(tmp_path), "server")
        create_certificates(str(tmp_path), "me")
        security = rf.ClientSecurity(secret_key_file=tmp_path / "me.key_secret",
                                     server_public_file=tmp_path / "server.key")  # fmt: skip
    with anyio.fail_after(20):
        async with rf.Registry.serve("tcp://127.0.0.1:*") as server:
            address = server.address
        async with RegistryClient(address, request_timeout_s=0.3, security=security) as client:  # nobody there now
            with pytest.raises(rf.RefitTimeoutError) as err:
                await client.versions(ident)
    text = str(err.value)
    assert f"refitflow registry --bind {address}" in text
    assert ("authorized folder" if curve else "security=rf.DeploymentKeys(<folder>, role=...).client") in text
