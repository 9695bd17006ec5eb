"""Structured outputs (qwen35_lib.engine.structured): grammars compiled by llguidance over the test tokenizer
(byte-level, the tiny model's 256 ids), their masks, the processing row against its reference twin, and the
engine's outputs under a grammar against a reference decode (the full forward, the grammar's mask, argmax), with
plain requests in the same batch untouched."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from qwen35_lib import get_config, init_weights
from qwen35_lib.engine import Engine, EngineConfig, SamplingParams
from qwen35_lib.engine.sampling import (
    fill_processing_row,
    grammar_allowed,
    process_logits,
    processing_arrays,
    reference_logits,
)
from qwen35_lib.text import load_text
from tests.engine.test_sampling import _forward_fn
from tests.test_text import make_tokenizer_dir

structured = pytest.importorskip("qwen35_lib.engine.structured")
pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["answer", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return load_text(make_tokenizer_dir(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def vocab(text):
    cfg = get_config("qwen3.5-tiny", dtype="float32")
    return structured.GrammarVocabulary(text.tokenizer.to_str(), cfg.vocab_size, cfg.eos_token_ids)


def _ids(text, s: str) -> list[int]:
    return text.encode(s)


def test_each_kind_compiles_and_a_bad_spec_is_a_value_error_naming_it(vocab):
    for kind, spec in [("json", SCHEMA), ("json", json.dumps(SCHEMA)), ("json_object", None), ("regex", r"\d{3}"),
                       ("choice", ["a", "b"]), ("grammar", 'start: "x" | "y"')]:
        assert structured.compile_grammar(vocab, kind, spec).matcher().allowed([]).any(), kind
    for kind, spec, match in [("json", {"type": "frob"}, "frob"), ("json", "{not json", "not valid JSON"),
                              ("json", [1], "object"), ("regex", "[a-", "regex"), ("choice", [], "list of strings"),
                              ("choice", "a", "list of strings"), ("grammar", "start: foo", "unknown name"),
                              ("xml", "", "unknown grammar kind")]:
        with pytest.raises(ValueError, match=match):
            structured.compile_grammar(vocab, kind, spec)


def test_a_matcher_follows_the_output_and_ends_on_eos(vocab, text):
    g = structured.compile_grammar(vocab, "choice", ["alpha", "beta"])
    m = g.matcher()
    first = np.flatnonzero(m.allowed([]))
    assert sorted(first) == sorted({_ids(text, "a")[0], _ids(text, "b")[0]})
    out = _ids(text, "beta")
    assert np.flatnonzero(m.allowed(out[:2])).tolist() == _ids(text, "t")  # "be" -> "t" only
    assert np.flatnonzero(m.allowed(out)).tolist() == list(vocab.eos_ids) and m.done  # complete: EOS only
    other = g.matcher()  # each request its own state
    assert np.array_equal(np.flatnonzero(other.allowed([])), first)
    forced = g.matcher()  # a token the grammar refused (forced by nothing here, but never an empty mask)
    assert np.flatnonzero(forced.allowed(_ids(text, "z"))).tolist() == list(vocab.eos_ids) and forced.error
    with pytest.raises(ValueError, match="never shrink"):
        m.allowed([])


def test_processing_row_with_a_grammar_equals_the_reference(vocab, text):
    V = vocab.vocab_size
    g = structured.compile_grammar(vocab, "regex", r"[0-9]+")
    rng = np.random.default_rng(0)
    eos = list(vocab.eos_ids)
    rows = [(SamplingParams(structured=g), [], ()),  # digits only; EOS not yet
            (SamplingParams(structured=g), _ids(text, "12"), eos),  # digits or EOS
            (SamplingParams(structured=g, stop_token_ids=[7, 1]), _ids(text, "3"), [7, 1]),  # stop ids with EOS
            (SamplingParams(structured=g, min_tokens=3), _ids(text, "4"), eos),  # min_tokens bans EOS: digits
            (SamplingParams(structured=g, logit_bias={_ids(text, "5")[0]: 50.0}), [], eos)]
    done = structured.compile_grammar(vocab, "choice", ["7"])
    rows.append((SamplingParams(structured=done, min_tokens=5), _ids(text, "7"), eos))  # grammar wins over min_tokens
    logits = rng.standard_normal((len(rows), V)).astype(np.float32) * 3
    arr = processing_arrays((len(rows),), V)
    masks = []
    for i, (p, out, stop) in enumerate(rows):
        fill_processing_row(arr, i, p, [5, 6], out, stop, p.structured.matcher())
        masks.append(grammar_allowed(p.structured.matcher(), out, stop))
    got = np.asarray(jax.jit(process_logits)(logits, arr))
    for i, (p, out, stop) in enumerate(rows):
        want = reference_logits(logits[i], p, [5, 6], out, stop, masks[i])
        np.testing.assert_allclose(got[i], want, rtol=1e-5, atol=1e-5, err_msg=f"row {i}")
    digits = set(_ids(text, "0123456789"))
    assert set(np.flatnonzero(np.isfinite(got[0]))) == digits
    assert set(np.flatnonzero(np.isfinite(got[1]))) == digits | set(eos)
    assert set(np.flatnonzero(np.isfinite(got[2]))) == digits | {1, 7}
    assert set(np.flatnonzero(np.isfinite(got[3]))) == digits
    assert int(np.argmax(got[4])) == _ids(text, "5")[0]
    assert np.flatnonzero(np.isfinite(got[5])).tolist() == eos


def reference_decode(cfg, w, prompt, p: SamplingParams, n: int) -> list[int]:
    """Greedy by repeated full forwards, each step's logits through `reference_logits` with the grammar's mask (a
    fresh matcher fed the outputs so far)."""
    out: list[int] = []
    step = _forward_fn(cfg, w)
    stop = () if p.ignore_eos else (p.stop_token_ids if p.stop_token_ids is not None else cfg.eos_token_ids)
    for _ in range(n):
        ids = prompt + out
        row = np.zeros((1, 64), np.int32)
        row[0, :len(ids)] = ids
        logits = np.asarray(step(row, np.asarray([len(ids)], np.int32)))[0, len(ids) - 1]
        mask = grammar_allowed(p.structured.matcher(), out, stop)
        t = int(np.argmax(reference_logits(logits, p, prompt, out, stop, mask)))
        out.append(t)
        if t in stop:
            break
    return out


def test_engine_outputs_follow_the_grammar_and_leave_the_rest_of_the_batch_alone(vocab, text):
    jsonschema = pytest.importorskip("jsonschema")
    cfg = get_config("qwen3.5-tiny", dtype="float32")
    w = init_weights(cfg, 0)
    ec = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, page_size=8, max_model_len=64)
    engine = Engine(cfg, w, ec)
    engine.decode_buckets = (8,)
    prompt = _ids(text, "JSON: ")
    tight = structured.compile_grammar(vocab, "json", SCHEMA, whitespace_flexible=False)
    cases = [SamplingParams(max_new_tokens=40, structured=tight),
             SamplingParams(max_new_tokens=12, structured=structured.compile_grammar(vocab, "regex", r"[a-c]{3}-\d\d")),
             SamplingParams(max_new_tokens=12, structured=structured.compile_grammar(vocab, "choice", ["no", "maybe"])),
             SamplingParams(max_new_tokens=12, ignore_eos=True),
             SamplingParams(max_new_tokens=40, temperature=1.0, seed=3,
                            structured=structured.compile_grammar(vocab, "json", SCHEMA))]
    results = engine.generate([prompt] * len(cases), cases)  # one batch: grammar and plain rows together
    alone = Engine(cfg, w, ec)
    alone.decode_buckets = (8,)
    assert results[3].output_ids == alone.generate([prompt], cases[3])[0].output_ids  # the plain row untouched
    for p, r in list(zip(cases, results))[:3]:
        assert r.output_ids == reference_decode(cfg, w, prompt, p, p.max_new_tokens), p.structured
    for i in (0, 1, 2, 4):
        assert results[i].finish_reason == "eos" and results[i].output_ids[-1] in cfg.eos_token_ids, i
    body = lambda r: text.decode(r.output_ids[:-1])
    for i in (0, 4):
        jsonschema.validate(json.loads(body(results[i])), SCHEMA)
    assert body(results[1])[:3] in {a + b + c for a in "abc" for b in "abc" for c in "abc"}
    assert body(results[2]) in ("no", "maybe")
    with pytest.raises(TypeError, match="structured must be None or a compiled grammar"):
        SamplingParams(structured="{}")


def test_a_grammar_after_a_marker_leaves_the_outputs_before_it_free(vocab, text):
    g = structured.compile_grammar(vocab, "choice", ["yes", "no"])
    marker = tuple(_ids(text, "</t>"))
    m = g.after(marker).matcher()
    free = _ids(text, "hm </t")  # the marker not yet whole: no constraint
    assert m.allowed(free) is None and m.allowed(free + _ids(text, "x")) is None
    out = free + _ids(text, "x</t>")
    assert sorted(np.flatnonzero(m.allowed(out))) == sorted({_ids(text, "y")[0], _ids(text, "n")[0]})
    assert np.flatnonzero(m.allowed(out + _ids(text, "no"))).tolist() == list(vocab.eos_ids)
    split = g.after(marker).matcher()  # the marker arriving one token a step
    seen = []
    for t in _ids(text, "a</t>"):
        seen.append(t)
        assert split.allowed(seen) is None or seen == _ids(text, "a</t>")
    assert split.allowed(seen) is not None and split.start == len(seen)
    with pytest.raises(ValueError, match="at least one token"):
        g.after(())


def test_the_engine_applies_a_grammar_only_after_its_marker(vocab, text):
    cfg = get_config("qwen3.5-tiny", dtype="float32")
    w = init_weights(cfg, 0)
    ec = EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, page_size=8, max_model_len=64)
    engine = Engine(cfg, w, ec)
    engine.decode_buckets = (8,)
    prompt = _ids(text, "think: ")
    free = engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))[0].output_ids
    k = 2  # the free output's third token is the marker: the grammar starts after its first occurrence
    k = free.index(free[k])
    g = structured.compile_grammar(vocab, "choice", ["no", "maybe"]).after((free[k],))
    p = SamplingParams(max_new_tokens=20, structured=g)
    out = engine.generate([prompt], p)[0].output_ids
    assert out[:k + 1] == free[:k + 1] and text.decode(out[k + 1:-1]) in ("no", "maybe"), (free, out)
    assert out == reference_decode(cfg, w, prompt, p, p.max_new_tokens)
