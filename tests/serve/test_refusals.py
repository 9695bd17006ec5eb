"""`serve.refusals`: a pydantic error as one line naming the field, what it must be and what was sent."""

from __future__ import annotations

from qwen35_lib.serve import refusals


def test_messages_name_the_path_and_the_expected_type():
    where = "/v1/completions"
    assert refusals.message({"type": "int_type", "loc": ("n",), "input": "5", "msg": ""}, where) == \
        ("`n` must be an integer, got a string", "n")
    assert refusals.message({"type": "missing", "loc": ("messages", 2, "role"), "input": {}, "msg": ""}, where) == \
        ("`messages[2].role` is required", "messages")
    union = {"type": "list_type", "loc": ("messages", 0, "content", "list[TextPart]"), "input": 5, "msg": ""}
    text, param = refusals.message(union, where)
    assert text.startswith("`messages[0].content` must be a string or a list of text parts") and param == "messages"
    assert refusals.message({"type": "extra_forbidden", "loc": ("x",), "input": 1, "msg": ""}, where)[0] == (
        "unknown field `x` for /v1/completions; remove it, or start the server with --ignore-unknown-fields to "
        "ignore fields it does not know")
    assert refusals.message({"type": "greater_than_equal", "loc": ("n",), "input": 0, "msg": "", "ctx": {"ge": 1}},
                            where)[0] == "`n` must be >= 1, got 0"
    assert refusals.short("y" * 100) == repr("y" * 100)[:40] and refusals.short(2**70) == str(2**70)


def test_the_first_error_is_a_refused_or_unknown_field_then_body_order():
    errors = [{"type": "int_type", "loc": ("n",)}, {"type": "int_type", "loc": ("top_k",)},
              {"type": "extra_forbidden", "loc": ("zz",)}]
    assert refusals.first(errors, {"top_k": 1, "n": 1, "zz": 1})["loc"] == ("zz",)
    assert refusals.first(errors[:2], {"top_k": 1, "n": 1})["loc"] == ("top_k",)


def test_an_unknown_field_name_is_shown_in_one_short_line():
    for name in ("a\nb", "x" * 10_000, "\u2028", "tab\there"):
        text, param = refusals.message({"type": "extra_forbidden", "loc": (name,), "input": 1, "msg": ""}, "/v1/x")
        assert param == name and len(text) < 200 and text.isprintable(), text
    assert refusals.message({"type": "extra_forbidden", "loc": ("a\nb",), "input": 1, "msg": ""}, "/v1/x")[0] \
        .startswith("unknown field 'a\\nb' for /v1/x;")
