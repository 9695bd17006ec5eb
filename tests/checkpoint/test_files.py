"""checkpoint.files: the folder, its index and its files (plain names only, regular files, symlinks into a blob
store followed, broken index or non-safetensors files refused in one line that names the file and the fix)."""

from __future__ import annotations

import os
import re
import shutil

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from qwen35_lib import testing  # noqa: E402
from qwen35_lib.checkpoint import CheckpointError, load_hf_checkpoint, path_infos  # noqa: E402
from qwen35_lib.config import ConfigError  # noqa: E402
from qwen35_lib.safetensors_io import SafeTensorsError  # noqa: E402
from tests.checkpoint.support import edited, one_line, set_entry, sharded_copy  # noqa: E402

pytestmark = [pytest.mark.reference, pytest.mark.filterwarnings("ignore:.*falling back:UserWarning")]


def test_bad_directories(ckpts, tmp_path):
    src = ckpts("qwen3_5_moe", "per_expert")
    path = edited(src, tmp_path / "llama", config={"model_type": "llama"})
    with pytest.raises(ValueError, match="unknown model_type 'llama'"):
        load_hf_checkpoint(path)
    (tmp_path / "empty").mkdir()
    shutil.copy(src / "config.json", tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors files .* safetensors only"):
        load_hf_checkpoint(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_checkpoint(tmp_path)
    sharded = tmp_path / "sharded"
    shutil.copytree(ckpts("qwen3_5_moe", "sharded"), sharded)
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="names 1 files missing"):
        load_hf_checkpoint(sharded)
    with pytest.raises(ValueError, match="no FP8 weights"):
        load_hf_checkpoint(src, expert_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="fp8='bogus'"):
        load_hf_checkpoint(src, fp8="bogus")


def test_overlapping_offsets_are_refused(ckpts, tmp_path):
    """The embedding's entry pointing at lm_head's bytes (same shape) used to load it as a copy of lm_head."""
    path = shutil.copytree(ckpts("qwen3_5_moe", "fused"), tmp_path / "alias")

    def alias(header):
        header["model.embed_tokens.weight"]["data_offsets"] = header["lm_head.weight"]["data_offsets"]

    testing.edit_header(path / "model.safetensors", alias)
    with pytest.raises(SafeTensorsError, match=r"model\.safetensors: tensor '(lm_head|model\.embed_tokens)\.weight' "
                                               r"starts at byte \d+, where \d+ was next: it overlaps") as e:
        load_hf_checkpoint(path)
    one_line(e)


@pytest.mark.parametrize("entry", ["../outside.safetensors", "ABS", "sub/model.safetensors", "..", "", ".",
                                   "a\\b.safetensors"])
def test_index_entries_are_plain_file_names(ckpts, tmp_path, entry):
    """An index naming `../x` or an absolute path used to open that file; only plain names in the folder pass."""
    path = sharded_copy(ckpts, tmp_path / "ckpt")
    shutil.copy(path / "model-00001-of-00003.safetensors", tmp_path / "outside.safetensors")  # a real file there
    (path / "sub").mkdir()
    shutil.copy(path / "model-00001-of-00003.safetensors", path / "sub" / "model.safetensors")
    entry = str(tmp_path / "outside.safetensors") if entry == "ABS" else entry
    set_entry(path, "model.norm.weight", entry)
    with pytest.raises(CheckpointError, match=r"index\.json: weight_map\['model\.norm\.weight'\] is "
                                              r".*, not a plain file name in the checkpoint folder") as e:
        load_hf_checkpoint(path)
    one_line(e)


@pytest.mark.timeout(60)
def test_special_files_are_refused_without_hanging(ckpts, tmp_path):
    """An index entry naming a FIFO used to hang on open; a FIFO or directory among `*.safetensors` too."""
    path = sharded_copy(ckpts, tmp_path / "fifo")
    (path / "model-00002-of-00003.safetensors").unlink()
    os.mkfifo(path / "model-00002-of-00003.safetensors")
    with pytest.raises(CheckpointError, match=r"model-00002-of-00003\.safetensors: a FIFO; a checkpoint's weights are "
                                              r"regular files"):
        load_hf_checkpoint(path)
    path = shutil.copytree(ckpts("qwen3_5_moe", "fused"), tmp_path / "glob")
    (path / "extra.safetensors").mkdir()
    with pytest.raises(CheckpointError, match=r"extra\.safetensors: a directory"):
        load_hf_checkpoint(path)


def test_symlinks_into_a_blob_store_load(ckpts, tmp_path):
    """The Hugging Face cache layout: snapshots/<rev>/<file> are relative symlinks to ../../blobs/<hash>."""
    src = ckpts("qwen3_5_moe", "sharded")
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for i, f in enumerate(sorted(src.iterdir())):
        shutil.copy(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(f"../../blobs/blob{i}")
    config, weights = load_hf_checkpoint(snapshot)
    _, want = load_hf_checkpoint(src)
    for (p, a), (_, b) in zip(path_infos(weights), path_infos(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(p))


@pytest.mark.parametrize("text, error, match", [
    ('{"metadata": {}}', CheckpointError, "no weight_map object"),
    ('[1, 2]', CheckpointError, "no weight_map object"),
    ('{"weight_map": ["model-00001-of-00003.safetensors"]}', CheckpointError, "no weight_map object"),
    ('{"weight_map": {"model.norm.weight": 3}}', CheckpointError, r"weight_map\['model\.norm\.weight'\] is not a file"),
    ('{"weight_map": {\n  "a": "b",\n  oops}', ConfigError, r"invalid JSON at line 3, column 3: Expecting")])
def test_broken_index(ckpts, tmp_path, text, error, match):
    path = sharded_copy(ckpts, tmp_path / "index")
    (path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(error, match=rf"{re.escape(str(path / 'model.safetensors.index.json'))}: {match}") as e:
        load_hf_checkpoint(path)
    one_line(e)


def test_a_file_that_is_not_safetensors_is_not_printed(ckpts, tmp_path):
    """Today's error printed the first 8 bytes (as the header length); now nothing of the file is shown."""
    path = sharded_copy(ckpts, tmp_path / "text")
    secret = b"password=hunter2 and then some more text"
    (path / "model-00003-of-00003.safetensors").write_bytes(secret)
    with pytest.raises(SafeTensorsError, match=r"model-00003-of-00003\.safetensors: not a safetensors file") as e:
        load_hf_checkpoint(path)
    message = one_line(e)
    assert "hunter2" not in message and str(int.from_bytes(secret[:8], "little")) not in message

