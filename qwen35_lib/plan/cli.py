"""The serving plan's command-line flags, one set for every command that takes a plan (`generate`, `serve`, the
multi-host runner, `costmodel predict`, ...): `add_arguments(parser)` adds them, `from_args(args)` reads them back
as one `ServingPlan`, and `devices(args)` says how many devices a layout asks for.

    --stage NAME            a ladder stage (or `google_baseline`, `tpu_inference_3050`); where a command has one
    --layout NAME           a layout instead of a stage (`single`, the 8-device names, or the general forms)
    --routing NAME          EP layouts: replicate | all_to_all
    --fuse-allgather        replicate: top-k ids and weights in one all-gather
    --hierarchical-rs       replicate: reduce-scatter within each chip, then across chips
    --kernels FAMILY        xla | pallas; where a command has it (else each slot the platform's default)
    --devices N             the mesh's devices; default: every device present for a general layout, 8 for an
                            8-device name ($QWEN35_DEVICES, where set, stands for --devices)
"""

from __future__ import annotations

import argparse
import os

from qwen35_lib.plan.kernels import FAMILIES
from qwen35_lib.plan.layouts import LAYOUTS, ROUTINGS
from qwen35_lib.plan.record import ServingPlan
from qwen35_lib.plan.stages import EXTRA, LAYOUT_STAGES, STAGES, any_stage, custom_stage

DEVICES_ENV = "QWEN35_DEVICES"


def add_arguments(p, *, layout: str | None = "single", stage: str | None = None, kernels: bool = False,
                  devices: bool = True, what: str = "", auto: bool = False) -> None:
    """The plan flags on `p` (a parser or an argument group). layout: --layout's default (None: a stage unless
    --layout is given); stage: --stage's default (None: no --stage flag); kernels: add --kernels; devices: add
    --devices; what: a prefix for --layout's help; auto: --layout also takes `auto` (the command chooses the
    layout itself: `costmodel predict`; `from_args` refuses it)."""
    if stage is not None:
        p.add_argument("--stage", default=stage, choices=(*STAGES, *EXTRA, *LAYOUT_STAGES),
                       help=f"a stage of the ladder, or one of {', '.join((*EXTRA, *LAYOUT_STAGES))} (default: "
                            "%(default)s)")
    p.add_argument("--layout", choices=(*LAYOUTS, "auto") if auto else LAYOUTS, default=layout,
                   help=f"{what}how the model is split over the ('chip', 'core') mesh"
                        + (" (default: single, one device): " if layout == "single" else
                           " (default: %(default)s): " if layout else ", instead of --stage: ")
                        + "tp8, tp8_kvrep, tp8_ep8, dp4_tp2_ep8, dp8_ep8 on 8 devices, or the general tp, tp_kvrep, "
                          "tp_ep, dp_tp2_ep, dp_ep on every device present (or --devices)"
                        + ("; auto: the one the cost model prices best" if auto else ""))
    if devices:
        p.add_argument("--devices", type=int, metavar="N",
                       help="devices of the mesh for a multi-device layout: 1 or an even count (default: every device "
                            f"present for a general layout, 8 for an 8-device name; ${DEVICES_ENV} where set)")
    p.add_argument("--routing", choices=ROUTINGS, default="replicate",
                   help="MoE token routing of the EP layouts (tp_ep, dp_tp2_ep, dp_ep and their 8-device names; "
                        "default: replicate)")
    p.add_argument("--fuse-allgather", action="store_true",
                   help="replicate routing: top-k ids and weights in one all-gather")
    p.add_argument("--hierarchical-rs", action="store_true",
                   help="replicate routing: reduce-scatter within each chip, then across chips")
    if kernels:
        p.add_argument("--kernels", choices=FAMILIES, default="xla",
                       help="kernel family with --layout: xla (the XLA twins) or pallas (default: %(default)s)")


def from_args(args: argparse.Namespace) -> ServingPlan:
    """The plan the flags describe: --layout with its routing, collective flags and kernels, else --stage.

    The flags are checked here (`custom_stage`: the collective flags need an EP layout with routing replicate);
    the model and the mesh are checked where the plan meets them (`ServingPlan.bind(mesh, config)`)."""
    layout = getattr(args, "layout", None)
    if not layout:
        return any_stage(args.stage)
    if layout == "auto":
        raise ValueError("--layout auto is the command's own choice (costmodel predict prices every layout); name a "
                         "layout here")
    return custom_stage(layout, args.routing, args.fuse_allgather, args.hierarchical_rs, getattr(args, "kernels", None))


def requested_devices(args: argparse.Namespace | None = None) -> int | None:
    """--devices, else $QWEN35_DEVICES, else None (the layout's own count: every device present, or 8 for an
    8-device name); 1 or an even count."""
    n = getattr(args, "devices", None)
    if n is None:
        env = os.environ.get(DEVICES_ENV, "").strip()
        try:
            n = int(env) if env else None
        except ValueError:
            raise ValueError(f"${DEVICES_ENV}={env!r} is not a device count: set it to 1, 2, 4, 8, ...") from None
    if n is not None and (n < 1 or (n > 1 and n % 2)):
        raise ValueError(f"{n} devices do not form whole chips of 2 TensorCores: use 1 or an even count")
    return n


__all__ = ["DEVICES_ENV", "add_arguments", "from_args", "requested_devices"]
