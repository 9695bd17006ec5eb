"""The plan flags: parsed back into the plan they describe (a stage, or a layout with its routing, collective flags
and kernels), the flag combinations refused with a one-line reason, and the device count from --devices or the
environment."""

from __future__ import annotations

import argparse

import pytest

from qwen35_lib.plan import cli
from qwen35_lib.plan.stages import STAGES, TPU_INFERENCE_3050


def _parse(argv, **kw):
    p = argparse.ArgumentParser()
    cli.add_arguments(p, **kw)
    return p.parse_args(argv)


def test_defaults_are_one_device_with_the_platforms_kernels():
    args = _parse([])
    assert (args.layout, args.routing, args.fuse_allgather, args.hierarchical_rs, args.devices) == (
        "single", "replicate", False, False, None)
    plan = cli.from_args(args)
    assert (plan.layout, plan.kernels) == ("single", None)  # no --kernels flag: each slot the platform's default
    assert not hasattr(_parse([], devices=False), "devices")


def test_a_stage_unless_a_layout_is_given():
    assert cli.from_args(_parse([], layout=None, stage="kernels")) == STAGES["kernels"]
    assert cli.from_args(_parse(["--stage", "tpu_inference_3050"], layout=None, stage="baseline")) == \
        TPU_INFERENCE_3050
    plan = cli.from_args(_parse(["--layout", "dp8_ep8", "--fuse-allgather", "--hierarchical-rs", "--kernels",
                                 "pallas"], layout=None, stage="baseline", kernels=True))
    assert (plan.layout, plan.routing, plan.fuse_allgather, plan.hierarchical_rs, plan.kernels) == (
        "dp8_ep8", "replicate", True, True, "pallas")
    a2a = cli.from_args(_parse(["--layout", "dp_ep", "--routing", "all_to_all"], kernels=True))
    assert (a2a.layout, a2a.routing, a2a.kernels) == ("dp_ep", "all_to_all", "xla")


@pytest.mark.parametrize("argv, message", [
    (["--hierarchical-rs"], "layout 'single' has no collectives"),
    (["--layout", "tp8", "--fuse-allgather"], "apply to EP layouts with routing='replicate'; layout 'tp8' is not one"),
    (["--layout", "dp8_ep8", "--routing", "all_to_all", "--fuse-allgather"], "routing='replicate'"),
])
def test_collective_flags_without_an_ep_replicate_layout_are_refused(argv, message):
    with pytest.raises(ValueError, match=message) as e:
        cli.from_args(_parse(argv))
    assert "\n" not in str(e.value)


def test_an_unknown_layout_or_stage_is_a_parser_error(capsys):
    for argv in (["--layout", "tp16"], ["--stage", "turbo"]):
        with pytest.raises(SystemExit):
            _parse(argv, stage="baseline")
        assert "invalid choice" in capsys.readouterr().err


def test_devices_from_the_flag_else_the_environment(monkeypatch):
    monkeypatch.delenv(cli.DEVICES_ENV, raising=False)
    assert cli.requested_devices(_parse([])) is None and cli.requested_devices() is None
    assert cli.requested_devices(_parse(["--devices", "4"])) == 4
    monkeypatch.setenv(cli.DEVICES_ENV, " 16 ")
    assert cli.requested_devices(_parse([])) == 16 and cli.requested_devices(_parse(["--devices", "1"])) == 1
    monkeypatch.setenv(cli.DEVICES_ENV, "eight")
    with pytest.raises(ValueError, match=r"\$QWEN35_DEVICES='eight' is not a device count"):
        cli.requested_devices()
    for n in (3, 0, -2):
        with pytest.raises(ValueError, match=f"{n} devices do not form whole chips of 2 TensorCores"):
            cli.requested_devices(argparse.Namespace(devices=n))
