"""qwen35_lib.data: a data file is read from the package unless $QWEN35_DATA_DIR holds a file of that name."""

import json

import pytest

from qwen35_lib import data


def test_a_file_in_the_data_dir_replaces_the_packages(tmp_path, monkeypatch):
    packaged = data.read_json("hardware.json")
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path))
    assert data.read_json("hardware.json") == packaged  # no such file there: the package's
    (tmp_path / "hardware.json").write_text(json.dumps({"mine": 1}))
    assert data.path("hardware.json") == tmp_path / "hardware.json" and data.read_json("hardware.json") == {"mine": 1}
    with pytest.raises(FileNotFoundError, match="data file .*nothing.json is missing"):
        data.read_json("nothing.json")
