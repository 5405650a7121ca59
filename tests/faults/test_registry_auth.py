"""CURVE: secret keys are written private, and a refused handshake is an AuthenticationError naming the
key files, at once — not a timeout that says the registry "did not answer"."""

from __future__ import annotations

import re
import stat
from pathlib import Path

import anyio
import pytest

import refitflow as rf
from refitflow.cli.registry_cmd import keys_main
from refitflow.registry.client.client import RegistryClient
from tests.registry.test_registry_client import ID, manifest


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_are_written_private_and_public_keys_readable(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    assert keys_main([str(keys), "--clients", "trainer", "rollout"]) == 0
    assert mode(keys) == 0o700  # nobody else can even list it
    for name in ("server", "trainer", "rollout"):
        assert mode(keys / f"{name}.key_secret") == 0o600
        assert mode(keys / f"{name}.key") == 0o644
    assert mode(keys / "authorized") == 0o755
    held = {p.relative_to(keys / "authorized").as_posix() for p in (keys / "authorized").rglob("*.key")}
    assert held == {"trainer/trainer.key", "rollout/rollout.key"}  # the allow-list by role
    assert all(mode(p) == 0o644 for p in (keys / "authorized").rglob("*.key"))


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    assert keys_main([str(tmp_path / "keys"), "--clients", "trainer"]) == 0
    assert keys_main([str(tmp_path / "rogue"), "--clients", "trainer"]) == 0
    return tmp_path


def _cases(tmp: Path) -> dict[str, tuple[rf.ClientSecurity | None, str]]:
    keys, rogue = tmp / "keys", tmp / "rogue"
    return {
        "no key": (None, "requires CURVE"),
        "unknown key": (
            rf.ClientSecurity(secret_key_file=rogue / "trainer.key_secret", server_public_file=keys / "server.key"),
            str(rogue / "trainer.key_secret"),
        ),
        "wrong server key": (
            rf.ClientSecurity(secret_key_file=keys / "trainer.key_secret", server_public_file=rogue / "server.key"),
            str(rogue / "server.key"),
        ),
    }


@pytest.mark.parametrize("case", ["no key", "unknown key", "wrong server key"])
@pytest.mark.asyncio
async def test_a_refused_handshake_is_an_authentication_error_naming_the_key_files(keys: Path, case: str) -> None:
    security = rf.ServerSecurity(secret_key_file=keys / "keys" / "server.key_secret",
                                 authorized_dir=keys / "keys" / "authorized")  # fmt: skip
    client_security, named = _cases(keys)[case]
    with anyio.fail_after(60):
        async with rf.Registry.serve("tcp://127.0.0.1:*", security=security) as server:
            async with RegistryClient(server.address, security=client_security, request_timeout_s=60) as stranger:
                with anyio.fail_after(20), pytest.raises(rf.AuthenticationError, match=re.escape(named)):
                    await stranger.publish(manifest(1, 0))  # within 20 s of a 60 s request timeout
                with anyio.fail_after(20), pytest.raises(rf.AuthenticationError):
                    await stranger.latest(ID)  # asked again: a fresh handshake, refused again
            assert await server.registry.versions(ID) == []
            good = rf.ClientSecurity(secret_key_file=keys / "keys" / "trainer.key_secret",
                                     server_public_file=keys / "keys" / "server.key")  # fmt: skip
            async with RegistryClient(server.address, security=good) as trainer:
                await trainer.publish(manifest(1, 0))
                assert await server.registry.versions(ID) == [1]
