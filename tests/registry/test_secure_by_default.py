"""Secure by default: ``refitflow registry`` makes (or loads) the deployment's CURVE keys and refuses a client
without them; every other process finds the keys the same way (``REFITFLOW_KEYS``, else
``~/.refitflow/keys``); running open is an explicit choice, logged as a warning."""

from __future__ import annotations

import logging
import os
import re
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest
import torch

import refitflow as rf
from refitflow.cli.registry_cmd import keys_main
from refitflow.engine.solo_vote import SoloVote
from refitflow.integrations.hosting.keys import deployment_keys
from refitflow.registry.client.client import RegistryClient
from tests.registry.test_registry_client import ID, manifest

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def registry_cli(env: dict[str, str], *args: str) -> Iterator[tuple[str, str, subprocess.Popen[str]]]:
    """``refitflow registry`` on a free loopback port: (its address, its banner, the process)."""
    argv = [sys.executable, "-m", "refitflow", "registry", "--bind", "tcp://127.0.0.1:*", *args]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        found = re.search(r"serving at (tcp://\S+) ", banner)
        assert found, banner + (proc.stderr.read() if proc.stderr else "")
        yield found.group(1), banner, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "REFITFLOW_KEYS"}
    return env | {"HOME": str(home), "PYTHONPATH": str(ROOT / "src"), **extra}


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.asyncio
async def test_the_registry_makes_its_keys_on_first_run_and_admits_only_clients_holding_them(tmp_path: Path) -> None:
    env, folder = clean_env(tmp_path), tmp_path / ".refitflow" / "keys"
    with registry_cli(env) as (address, banner, _):
        assert f"CURVE keys made in {folder}" in banner and f"REFITFLOW_KEYS={folder}" in banner
        assert mode(folder) == 0o700 and mode(folder / "server.key_secret") == 0o600
        assert all(mode(folder / f"{role}.key_secret") == 0o600 for role in ("trainer", "rollout", "operator"))
        assert mode(folder / "server.key") == 0o644 and not (folder / "client.key_secret").exists()  # one per role
        keys = rf.find_keys({}, tmp_path, "trainer")  # a client on this host finds them with nothing set
        assert keys is not None and keys.folder == folder
        with anyio.fail_after(60):
            async with RegistryClient(address, request_timeout_s=30) as stranger:
                with pytest.raises(rf.AuthenticationError, match="requires CURVE"):
                    await stranger.publish(manifest(1, 0))
            async with RegistryClient(address, security=keys.client) as trainer:
                await trainer.publish(manifest(1, 0))
                assert await trainer.versions(ID) == [1]
    server_key = (folder / "server.key").read_bytes()
    with registry_cli(env) as (_, banner, _):  # a restart loads the same keys: clients keep working
        assert f"CURVE keys from {folder}" in banner
    assert (folder / "server.key").read_bytes() == server_key


@pytest.mark.parametrize("how", ["--open", "REFITFLOW_KEYS=open"])
@pytest.mark.asyncio
async def test_running_open_is_an_explicit_choice_and_said_out_loud(tmp_path: Path, how: str) -> None:
    env = clean_env(tmp_path, **({"REFITFLOW_KEYS": "open"} if how != "--open" else {}))
    with registry_cli(env, *([how] if how == "--open" else [])) as (address, banner, proc):
        assert "OPEN: no authentication" in banner
        with anyio.fail_after(60):
            async with RegistryClient(address) as anyone:
                await anyone.publish(manifest(1, 0))
    assert proc.stderr is not None and "the registry runs WITHOUT CURVE" in proc.stderr.read()
    assert not (tmp_path / ".refitflow").exists()  # no keys made


def test_the_three_ways_of_choosing_keys_cannot_be_mixed() -> None:
    proc = subprocess.run([sys.executable, "-m", "refitflow", "registry", "--open", "--keys", "k"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and "three different choices" in proc.stderr


def test_a_process_finds_its_keys_or_says_how_to_make_them(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys = rf.DeploymentKeys.create(tmp_path / "made")
    assert rf.find_keys({"REFITFLOW_KEYS": str(keys.folder)}, tmp_path / "elsewhere") == keys
    with pytest.raises(rf.ConfigError, match=r"does not exist: run `refitflow registry` once on this host"):
        rf.find_keys({}, tmp_path / "nobody")  # no folder anywhere: a sentence, not an open socket
    with pytest.raises(rf.ConfigError, match="REFITFLOW_KEYS=open runs without authentication"):
        rf.find_keys({"REFITFLOW_KEYS": str(tmp_path / "typo")}, tmp_path)
    with caplog.at_level(logging.WARNING):
        assert rf.find_keys({"REFITFLOW_KEYS": "open"}, tmp_path) is None
    assert "runs WITHOUT CURVE" in caplog.text


def test_an_integration_reads_its_keys_from_its_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = rf.DeploymentKeys.create(tmp_path / "deployment")
    monkeypatch.setenv("REFITFLOW_KEYS", str(keys.folder))
    assert deployment_keys() == keys
    found = deployment_keys("rollout")  # an inference server presents its role's pair
    assert found is not None and found.client.secret_key_file == keys.folder / "rollout.key_secret"
    monkeypatch.setenv("REFITFLOW_KEYS", str(tmp_path / "missing"))
    with pytest.raises(rf.ConfigError, match="refitflow keys DIR"):
        deployment_keys()
    monkeypatch.setenv("REFITFLOW_KEYS", "open")
    assert deployment_keys() is None


@pytest.mark.asyncio
async def test_an_address_with_keys_connects_publishers_and_receivers(tmp_path: Path) -> None:
    """The library takes keys explicitly: ``security=`` beside a registry address."""
    keys = rf.DeploymentKeys.create(tmp_path / "deployment")
    model = {"w": torch.arange(4096, dtype=torch.float32)}
    recv_model = {"w": torch.zeros(4096)}
    with anyio.fail_after(60):
        async with rf.Registry.serve("tcp://127.0.0.1:*", security=keys.server) as server:
            async with (
                rf.Publisher(server.address, identity=ID, transport="nixl", security=keys) as pub,  # trainer pair
                rf.Receiver(
                    recv_model, server.address, identity=ID, transport="nixl", security=keys  # rollout pair
                ) as recv,  # fmt: skip
            ):
                await pub.publish(1, model)
                await recv.refit(1, timeout=30)
                assert torch.equal(recv_model["w"], model["w"]) and recv.status.committed_version == 1
    with pytest.raises(rf.ConfigError, match="security= is for a registry address"):
        rf.Publisher(rf.Registry(), identity=ID, security=keys)


def test_making_keys_again_keeps_the_deployments_keys_unless_forced(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    assert keys_main([str(folder)]) == 0
    server, trainer = (folder / "server.key").read_bytes(), (folder / "trainer.key_secret").read_bytes()
    assert keys_main([str(folder), "--clients", "trainer", "rollout-b:rollout"]) == 0  # another rollout pair joins
    assert (folder / "server.key").read_bytes() == server and (folder / "trainer.key_secret").read_bytes() == trainer
    assert (folder / "authorized" / "rollout" / "rollout-b.key").is_file()
    assert mode(folder / "rollout-b.key_secret") == 0o600 and mode(folder / "authorized" / "rollout") == 0o755
    assert keys_main([str(folder), "--force"]) == 0
    assert (folder / "server.key").read_bytes() != server


@pytest.mark.asyncio
async def test_an_open_socket_where_other_hosts_reach_it_is_a_choice_never_a_default(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing binds beyond loopback without CURVE unless told ``insecure=True`` (refused before binding)."""
    member = rf.EngineMember(rf.Receiver({"w": torch.zeros(4)}, rf.Registry(), identity=ID), SoloVote())
    for make in (
        lambda: rf.ZmqVote(0, ["tcp://198.18.0.9:7300"]),
        lambda: rf.EngineAgent(member, "tcp://*:7400"),
    ):
        with pytest.raises(rf.ConfigError, match="without CURVE, where anyone who reaches it"):
            make()
    with pytest.raises(rf.ConfigError, match=r"the registry would bind tcp://198\.18\.0\.9:7100 without CURVE"):
        async with rf.Registry.serve("tcp://198.18.0.9:7100"):
            pass
    with caplog.at_level(logging.WARNING):
        rf.EngineAgent(member, "tcp://198.18.0.9:7400", insecure=True)  # said, and allowed
    assert "WITHOUT CURVE (insecure=True)" in caplog.text
    async with rf.Registry.serve("tcp://127.0.0.1:*"):  # loopback: this host only
        pass
