"""The TRL switch's configuration: ``GRPOConfig(weight_sync_backend=..., refitflow=...)`` refuses what cannot work
before anything starts (the run itself: ``test_trl_grpo.py``)."""

from __future__ import annotations

import pathlib

import pytest

import refitflow as rf
from refitflow.integrations.trl import GRPOConfig, RefitflowTrl


def config(tmp_path: pathlib.Path, **kw: object) -> GRPOConfig:
    base = {"output_dir": str(tmp_path), "use_cpu": True, "report_to": [], "use_vllm": True, "vllm_mode": "server"}
    return GRPOConfig(**(base | kw))  # type: ignore[arg-type]


def test_the_switch_and_its_options_are_checked_when_the_config_is_made(tmp_path: pathlib.Path) -> None:
    assert config(tmp_path).weight_sync_backend == "nccl"  # TRL's own, unchanged
    made = config(tmp_path, weight_sync_backend="refitflow", refitflow='{"model": "m", "max_lag": 1}')
    assert made.refitflow == {"model": "m", "max_lag": 1}  # TRL's command line passes JSON
    assert RefitflowTrl.parse(made.refitflow) == RefitflowTrl(model="m", max_lag=1)
    with pytest.raises(rf.ConfigError, match="weight_sync_backend must be one of"):
        config(tmp_path, weight_sync_backend="refitflw")
    with pytest.raises(rf.ConfigError, match="needs use_vllm=True and vllm_mode='server'"):
        config(tmp_path, weight_sync_backend="refitflow", vllm_mode="colocate")
    with pytest.raises(rf.ConfigError, match=r"unknown refitflow option\(s\) \['modle'\]"):
        config(tmp_path, weight_sync_backend="refitflow", refitflow={"modle": "m"})
    with pytest.raises(rf.ConfigError, match="may not set \\['registry'\\]"):
        config(tmp_path, weight_sync_backend="refitflow", refitflow={"worker_init": {"registry": "tcp://h:1"}})
    with pytest.raises(rf.ConfigError, match="max_lag must be >= 0"):
        RefitflowTrl.parse({"max_lag": -1})
