"""qwen35_lib.text: a tokenizer from the test factory (`qwen35_lib.testing.make_tokenizer_dir`: byte-level BPE, ChatML
template), chat rendering, streaming decode."""

from __future__ import annotations

import ast
import json
import re

import pytest

from qwen35_lib.testing import CHATML, SKIPPED_BYTES, SPECIALS, make_tokenizer_dir  # noqa: F401 - re-exported
from qwen35_lib.text import REPLACEMENT, load_text, render_chat


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return load_text(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


def test_tokenizer_fits_the_tiny_vocabulary(text):
    assert text.vocab_size == 256
    ids = text.encode("héllo 世界 🙂")
    assert max(ids) < 253 and text.decode(ids) == "héllo 世界 🙂"


def test_chat_template_renders_as_chatml_and_encodes_specials(text):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    rendered = text.apply_chat_template(messages)
    assert rendered == "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhéllo<|im_end|>\n" \
                       "<|im_start|>assistant\n"
    assert not text.apply_chat_template(messages, add_generation_prompt=False).endswith("assistant\n")
    ids = text.encode_chat(messages)
    assert ids.count(254) == 3 and ids.count(255) == 2  # <|im_start|> x3, <|im_end|> x2, each one token
    assert text.decode(ids, skip_special_tokens=False) == rendered


def test_template_uses_hf_environment():
    # trim_blocks / lstrip_blocks, tojson keeping non-ASCII, loop controls, special-token variables,
    # raise_exception turned into a ValueError
    tpl = ("{% for m in messages %}\n  {% if m.role == 'skip' %}{% continue %}{% endif %}\n"
           "{{ m.content | tojson }}{{ eos_token }}\n{% endfor %}")
    out = render_chat(tpl, [{"role": "user", "content": "é"}, {"role": "skip", "content": "x"}],
                      special_tokens={"eos_token": "</s>"})
    assert out == '"é"</s>\n'
    with pytest.raises(ValueError, match="only user"):
        render_chat("{{ raise_exception('only user') }}", [{"role": "x", "content": ""}])


def test_bad_messages_and_missing_template(text, tmp_path):
    with pytest.raises(ValueError, match="non-empty list"):
        text.encode_chat([])
    with pytest.raises(ValueError, match="role"):
        text.encode_chat([{"content": "x"}])
    (tmp_path / "tokenizer.json").write_text((make_tokenizer_dir(tmp_path / "t") / "tokenizer.json").read_text())
    bare = load_text(tmp_path)
    assert bare.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        bare.encode_chat([{"role": "user", "content": "x"}])
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_text(tmp_path / "nowhere")


@pytest.mark.parametrize("sample", ["héllo 世界 🙂!", "🙂🙂", "a\u00e9\u4e16", "plain ascii"])
def test_streaming_never_breaks_multibyte_characters(text, sample):
    ids = text.encode(sample)
    assert len(ids) == len(sample.encode())  # one token per byte: every multi-byte character spans tokens
    assert any(REPLACEMENT in text.decode([t]) for t in ids) == (not sample.isascii())  # what decode([t]) does
    stream = text.detokenizer()
    pieces = [stream.push(t) for t in ids]
    pieces.append(stream.flush())
    assert "".join(pieces) == sample == stream.text
    assert not any(REPLACEMENT in p for p in pieces)
    assert pieces.count("") >= len(sample.encode()) - len(sample)  # held back while a character was partial


def test_streaming_skips_special_tokens_and_flushes_invalid_bytes(text):
    stream = text.detokenizer()
    ids = text.encode("ok") + [255] + text.encode("é")[:1]  # a special token, then a lone lead byte
    out = "".join(stream.push(t) for t in ids)
    assert out == "ok"
    assert stream.flush() == REPLACEMENT  # a sequence that never completes is shown as U+FFFD at the end
    raw = text.detokenizer(skip_special_tokens=False)
    assert "".join(raw.push(t) for t in text.encode("a") + [255]) == "a<|im_end|>"


def test_generate_chat_applies_the_template_and_streams_text(tmp_path, capsys):
    """`generate --chat --prompt TEXT`: the prompt ids are the template's; the streamed pieces join to the text.
    (`--profile DIR` on the same run: a jax.profiler trace is written.)"""
    pytest.importorskip("transformers")
    from qwen35_lib.__main__ import main
    from qwen35_lib.testing import make_hf_model, save_hf_checkpoint

    path = save_hf_checkpoint(make_hf_model("qwen3_5_moe", seed=1), tmp_path / "ckpt", "fused")
    text = load_text(make_tokenizer_dir(path))
    argv = ["generate", "--checkpoint", str(path), "--chat", "--prompt", "héllo", "--max-new-tokens", "6",
            "--ignore-eos", "--max-model-len", "64", "--max-num-batched-tokens", "64", "--json",
            "--profile", str(tmp_path / "prof")]
    assert main(argv) == 0
    out = capsys.readouterr()
    req = json.loads(out.out)["requests"][0]
    assert req["prompt_ids"] == text.encode_chat([{"role": "user", "content": "héllo"}])
    pieces = [ast.literal_eval(m) for m in re.findall(r"^\[req 0\] \d+ ('.*'|\".*\")$", out.err, flags=re.M)]
    assert len(pieces) == 6 and req["text"].startswith("".join(pieces))  # the held-back tail is only in "text"
    assert list((tmp_path / "prof").glob("plugins/profile/*/*.xplane.pb"))
    assert main(["generate", "--chat", "--prompt-ids", "1 2"]) == 2
    assert "--chat applies the checkpoint's chat template" in capsys.readouterr().err


def test_a_template_is_compiled_once_and_a_broken_one_refused_each_time():
    from qwen35_lib import text as text_mod

    tpl = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ strftime_now('%Y') | length }}"
    text_mod._compiled.cache_clear()
    first = render_chat(tpl, [{"role": "user", "content": "a"}])
    second = render_chat(tpl, [{"role": "user", "content": "b"}])
    assert (first, second) == ("<user>a4", "<user>b4")
    info = text_mod._compiled.cache_info()
    assert (info.misses, info.hits) == (1, 1)
    for _ in range(2):  # a compile error is not cached away: refused, in one line, every time
        with pytest.raises(ValueError, match="the chat template failed on these messages: .*") as e:
            render_chat("{% for m in messages %}", [])
        assert "\n" not in str(e.value)
