"""playbook.facts: the primer quotes the library's hardware table, nothing missing."""

from __future__ import annotations

from playbook import site
from playbook.results import Results, format_value


def test_the_primer_quotes_the_librarys_hardware_and_nothing_is_missing():
    """Every placeholder of chapters/primer.md fills from `playbook.facts` (no notebook runs for it), and the
    values are the library's: the TPU7x usable HBM per device, the ridge point, a decode step's copies per expert."""
    from playbook import facts
    from qwen35_lib import hardware

    text = (site.CHAPTERS / "primer.md").read_text()
    # the primer also shows notebook 00's mesh figure: with no notebook run here, it is shown missing
    filled, values = Results([], {"00"}, facts={facts.STEP: facts.documents()}).fill(text, "primer.md")
    assert "figure mesh missing" in filled
    assert values and all(v.text is not None for v in values) and "{{ result" not in filled
    got = {v.path: v.text for v in values}
    hw = hardware.get("tpu7x-8")
    assert got["primer.systems.tpu7x-8.usable_hbm_bytes_per_device"] == format_value(
        hw.usable_hbm_bytes_per_device, "bytes")
    ridge = hw.peak_bf16_flops_per_chip / hw.hbm_bytes_per_s_per_chip
    assert got["primer.systems.tpu7x-8.ridge_bf16"] == f"{ridge:.0f}"
    assert got["primer.decode.qwen3.5-397b-a17b.copies_per_expert"] == "10"  # 512 requests x top-10 / 512 experts
