"""plan.layouts: an 8-device layout name and its general layout are one placement, on 1, 2, 4 and 8 devices."""

import pytest

from qwen35_lib import get_config
from qwen35_lib import plan as plan_lib


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_general_and_8_device_names_are_one_placement(devices):
    cfg = get_config("qwen3.5-397b-a17b")
    for name, general in plan_lib.INSTANCES.items():
        assert plan_lib.get_layout(name).rules is plan_lib.get_layout(general).rules
    for s in plan_lib.STAGES.values():  # on other device counts the cost model runs the stage's general form
        lay = s.on_devices(devices).bind(plan_lib.abstract_mesh(devices), cfg)
        assert lay.layout == (s.layout if devices == 8 else "single" if devices == 1 else s.general)
        assert lay.dp * (lay.tp if lay.moe == "tp" else 1) <= devices and lay.name == s.name
