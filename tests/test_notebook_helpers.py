"""The two calls every notebook makes: `notebook.setup()` and `notebook.save_results(...)`."""

import json

import jax
import pytest

from qwen35_lib import notebook


def test_setup_gives_the_simulated_devices_and_the_size(monkeypatch, capsys):
    monkeypatch.setattr(notebook, "has_accelerator", lambda: False)
    monkeypatch.delenv(notebook.SIZE_ENV, raising=False)
    devices, size = notebook.setup()
    assert devices == jax.devices() and len(devices) == 8 and size == "cpu"
    assert capsys.readouterr().out.startswith("8 x ")
    monkeypatch.setenv(notebook.SIZE_ENV, "tpu")
    assert notebook.setup()[1] == "tpu"
    monkeypatch.setenv(notebook.SIZE_ENV, "huge")
    with pytest.raises(ValueError, match=r"\$QWEN35_SIZE='huge': use one of cpu, tpu"):
        notebook.setup()


def test_setup_refuses_a_backend_started_with_another_device_count(monkeypatch):
    monkeypatch.setattr(notebook, "has_accelerator", lambda: False)
    with pytest.raises(RuntimeError, match="JAX started with 8 CPU devices, not 4: restart the kernel"):
        notebook.setup(cpu_devices=4)


def test_results_are_written_only_for_the_builder(tmp_path, monkeypatch):
    monkeypatch.delenv(notebook.RESULTS_ENV, raising=False)
    assert notebook.save_results("demo", {"x": 1}) is None
    monkeypatch.setenv(notebook.RESULTS_ENV, str(tmp_path))
    path = notebook.save_results("demo", {"x": 1})
    assert path == tmp_path / "demo.json" and json.loads(path.read_text()) == {"x": 1}


def test_setup_runs_a_one_device_accelerator_runtime_on_simulated_cpu_devices(monkeypatch, capsys):
    """A Colab TPU v5e-1 / GPU runtime has 1 device: the 8-device layouts run on 8 simulated CPU devices, said so."""
    import jax

    platforms = []
    monkeypatch.setattr(notebook, "accelerator_device_count", lambda: 1)
    monkeypatch.setattr(jax.config, "update", lambda name, value: platforms.append((name, value)))
    monkeypatch.delenv(notebook.SIZE_ENV, raising=False)
    devices, size = notebook.setup()
    assert ("jax_platforms", "cpu") in platforms and size == "cpu" and len(devices) == 8
    assert "1 accelerator device(s), fewer than the 8" in capsys.readouterr().out


def test_the_accelerator_count_is_probed_only_where_there_is_one(monkeypatch):
    monkeypatch.setattr(notebook, "has_accelerator", lambda: False)
    assert notebook.accelerator_device_count() == 0
