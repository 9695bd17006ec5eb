"""`python -m qwen35_lib.aot`: anything but `sweep` is refused with one `error: usage` line and status 2."""

from qwen35_lib.aot.__main__ import main


def test_only_sweep_is_a_command(capsys):
    assert main([]) == 2 and "got nothing" in capsys.readouterr().err
    assert main(["compile", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: usage: python -m qwen35_lib.aot sweep") and "got compile x" in err
