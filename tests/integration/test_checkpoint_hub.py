"""`--checkpoint` by hub id from the local Hugging Face cache only, and the CLI's --fp8 / --kv-cache-dtype options.

The cache is faked in tmp as huggingface_hub lays it out (HF_HUB_CACHE points at it):
    models--org--name/blobs/<sha256>                 the files' bytes
    models--org--name/snapshots/<commit>/<file>      symlinks ../../blobs/<sha256>
    models--org--name/refs/main                      <commit>
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

from qwen35_lib import testing  # noqa: E402
from qwen35_lib.__main__ import main  # noqa: E402
from qwen35_lib.checkpoint import load_hf_checkpoint, path_infos  # noqa: E402
from qwen35_lib.cli_generate import is_hub_id, resolve_checkpoint  # noqa: E402

pytestmark = [pytest.mark.reference, pytest.mark.filterwarnings("ignore:.*falling back:UserWarning")]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_cache(cache: pathlib.Path, repo: str, folder: pathlib.Path) -> pathlib.Path:
    """Put `folder`'s files into `cache` as the hub cache holds `repo` at refs/main; returns the snapshot folder."""
    top = cache / ("models--" + repo.replace("/", "--"))
    snapshot = top / "snapshots" / COMMIT
    (top / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted(folder.iterdir()):
        blob = hashlib.sha256(f.read_bytes()).hexdigest()
        (top / "blobs" / blob).write_bytes(f.read_bytes())
        os.symlink(pathlib.Path("..", "..", "blobs", blob), snapshot / f.name)
    (top / "refs").mkdir()
    (top / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A cache holding org/tiny (per-expert float32) and org/tiny-fp8 (block-scaled FP8); the source folders."""
    root = tmp_path_factory.mktemp("hub")
    model = testing.make_hf_model("qwen3_5_moe")
    plain = testing.save_hf_checkpoint(model, root / "src" / "tiny", "per_expert")
    fp8 = testing.save_hf_checkpoint(model, root / "src" / "tiny-fp8", "fp8")
    cache = root / "cache"
    sources = {"org/tiny": plain, "org/tiny-fp8": fp8}
    return cache, {repo: fake_cache(cache, repo, folder) for repo, folder in sources.items()}, sources


@pytest.fixture()
def cached(hub, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub[0]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a network call would fail loudly rather than hang
    return hub


def test_hub_id_resolves_to_the_cached_snapshot(cached):
    """org/name -> its refs/main snapshot; the loader reads through the cache's symlinks what the folder holds."""
    _, snapshots, sources = cached
    path = resolve_checkpoint("org/tiny")
    assert path == snapshots["org/tiny"] and (path / "model.safetensors").is_symlink()
    _, from_cache = load_hf_checkpoint(path)
    _, from_folder = load_hf_checkpoint(sources["org/tiny"])
    for (p, a), (_, b) in zip(path_infos(from_cache), path_infos(from_folder), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg="/".join(p))
    assert resolve_checkpoint(str(sources["org/tiny"])) == sources["org/tiny"]  # a folder stays a folder


def test_absent_hub_id_says_the_download_command(cached, capsys):
    """Not in the cache: one line naming the cache and the `hf download` command; nothing is fetched."""
    assert main(["generate", "--checkpoint", "Qwen/Qwen3.5-397B-A17B-FP8", "--prompt-ids", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: Qwen/Qwen3.5-397B-A17B-FP8 is neither a directory nor in "
                                               f"the local Hugging Face cache ({cached[0]})"), err
    assert "fetch it with `hf download Qwen/Qwen3.5-397B-A17B-FP8`" in err[0]
    assert not any(cached[0].glob("models--Qwen--*"))


@pytest.mark.parametrize("value, hub_id", [("org/name", True), ("Qwen/Qwen3.5-397B-A17B-FP8", True),
                                           ("./org/name", False), ("/abs/ckpt", False), ("a/b/c", False),
                                           ("org/..", False), ("name", False)])
def test_what_counts_as_a_hub_id(value, hub_id):
    assert is_hub_id(value) is hub_id


@pytest.mark.parametrize("args, message", [
    (["--fp8", "keep", "--prompt-ids", "1"], "--fp8 keep keeps an FP8 checkpoint's experts in FP8: give an FP8"),
    (["--checkpoint", "org/tiny", "--fp8", "keep", "--prompt-ids", "1"],
     "is not an FP8 checkpoint (its config.json has no quantization_config)"),
])
def test_fp8_keep_needs_an_fp8_checkpoint(cached, capsys, args, message):
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and message in err[-1], err


def test_generate_by_hub_id_with_fp8_experts_and_fp8_kv_cache(cached, capsys):
    """generate --checkpoint org/tiny-fp8 --fp8 keep --kv-cache-dtype fp8: the engine runs FP8 experts (BlockFP8
    leaves) and an FP8 KV cache, and reports both; the model is named by its hub id."""
    args = ["generate", "--checkpoint", "org/tiny-fp8", "--fp8", "keep", "--kv-cache-dtype", "fp8", "--prompt-ids",
            "3 4 5", "--max-new-tokens", "3", "--max-model-len", "64", "--json"]
    assert main(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["model"] == "org/tiny-fp8" and doc["checkpoint"] == str(cached[1]["org/tiny-fp8"])
    assert (doc["expert_dtype"], doc["kv_cache_dtype"]) == ("float8_e4m3fn", "float8_e4m3fn")
    assert len(doc["requests"][0]["output_ids"]) == 3
