"""Structured outputs on the wire: the request fields that ask for them, as vLLM names them, into one `Spec`, and the
server's grammar compiler (`Grammars`: llguidance over the server's tokenizer, compiled grammars cached).

The fields (at most one constraint a request; each refusal a 400 naming its field):
- `response_format`: {"type": "text"} (nothing), {"type": "json_object"} (any JSON object), {"type": "json_schema",
  "json_schema": {"name", "schema", "strict", "description"}} (OpenAI's);
- vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" | "json_object": true, with
  "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern"}; `structural_tag` is refused;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (with `guided_whitespace_pattern`);
  `guided_decoding_backend` is accepted as "auto", "guidance" or "llguidance" (the backend this server has).
A spec's size (its JSON text) is bounded by `Limits.max_grammar_bytes` (--max-grammar-bytes); the compile runs on
the request's parse thread (off the event loop), llguidance bounding its own work, and its errors name the field.
Under `--reasoning-parser`, a chat's grammar starts after `</think>` (`reasoning_marker`), as vLLM's does.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from typing import Any

from qwen35_lib.serve.parsers import END_THINK, THINK
from qwen35_lib.serve.protocol import APIError, Limits

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
          "guided_whitespace_pattern", "guided_decoding_backend")
BACKENDS = (None, "", "auto", "guidance", "llguidance")  # the backend this server has, by vLLM's names
SO_KINDS = ("json", "regex", "choice", "grammar", "json_object")
SO_OPTIONS = ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "disable_fallback")


@dataclasses.dataclass(frozen=True)
class Spec:
    """One request's structured-output constraint: `param` (the field it came in), `kind` (engine.structured's kinds),
    `spec` (the schema, regex, choices or grammar) and the JSON options."""

    param: str
    kind: str
    spec: Any
    whitespace_flexible: bool = True
    whitespace_pattern: str | None = None

    def key(self) -> str:
        return json.dumps([self.kind, self.spec, self.whitespace_flexible, self.whitespace_pattern], sort_keys=True)


def parse_spec(body: dict, limits: Limits) -> Spec | None:
    """The request's constraint, or None; a 400 naming the field for a malformed one, a second one, or one over
    --max-grammar-bytes."""
    found: list[Spec] = []
    backend = body.get("guided_decoding_backend")
    if backend not in BACKENDS:
        raise APIError(f"`guided_decoding_backend` {str(backend)[:40]!r} is not this server's: its structured outputs "
                       "use llguidance (vLLM's \"guidance\"); send \"guidance\", \"auto\" or leave it out",
                       "guided_decoding_backend")
    ws = body.get("guided_whitespace_pattern")
    if ws is not None and not isinstance(ws, str):
        raise APIError("`guided_whitespace_pattern` must be a string (a regex)", "guided_whitespace_pattern")
    rf = body.get("response_format")
    if rf is not None:
        found += _response_format(rf)
    so = body.get("structured_outputs")
    if so is not None:
        found += _structured_outputs(so)
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        v = body.get(name)
        if v is not None:
            found.append(Spec(name, kind, _checked(name, kind, v), whitespace_pattern=ws))
    choice = body.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):  # checked by protocol._tools: the tools are functions
        found.append(Spec("tool_choice", "json", tool_schema(body["tools"], choice)))
    if len(found) > 1:
        raise APIError(f"`{found[1].param}`: a request takes one structured-output constraint, and this one also has "
                       f"`{found[0].param}`; send one", found[1].param)
    if not found:
        if ws is not None:
            raise APIError("`guided_whitespace_pattern` applies to a JSON constraint (guided_json)",
                           "guided_whitespace_pattern")
        return None
    spec = found[0]
    size = len(spec.key().encode())
    if size > limits.max_grammar_bytes:
        raise APIError(f"`{spec.param}` is {size} bytes as JSON, more than --max-grammar-bytes "
                       f"{limits.max_grammar_bytes}; send a smaller schema, regex, choice list or grammar", spec.param)
    return spec


def _response_format(rf: Any) -> list[Spec]:
    name = "response_format"
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise APIError("`response_format` must be an object with a `type`: \"text\", \"json_object\" or "
                       "\"json_schema\"", name)
    kind = rf["type"]
    if kind == "text":
        return []
    if kind == "json_object":
        return [Spec(name, "json_object", None)]
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise APIError("`response_format` of type json_schema needs `json_schema`: {\"name\", \"schema\"}", name)
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:
            raise APIError("`response_format.json_schema` needs a `schema` (a JSON schema object)", name)
        return [Spec(name, "json", _checked(name, "json", schema))]
    if kind == "structural_tag":
        raise APIError("`response_format` of type structural_tag is not supported; send json_schema or use "
                       "`structured_outputs`", name)
    raise APIError(f"`response_format` type {kind[:40]!r} is not one of \"text\", \"json_object\", \"json_schema\"",
                   name)


def _structured_outputs(so: Any) -> list[Spec]:
    name = "structured_outputs"
    if not isinstance(so, dict):
        raise APIError("`structured_outputs` must be an object: {\"json\" | \"regex\" | \"choice\" | \"grammar\" | "
                       "\"json_object\": ...}", name)
    unknown = sorted(k for k in so if k not in SO_KINDS + SO_OPTIONS + ("structural_tag",))
    if unknown:
        raise APIError(f"`structured_outputs.{unknown[0][:40]}` is not a field this server knows; it takes "
                       f"{', '.join(SO_KINDS + SO_OPTIONS)}", name)
    if so.get("structural_tag") is not None:
        raise APIError("`structured_outputs.structural_tag` is not supported; send json, regex, choice or grammar",
                       name)
    for opt in ("disable_any_whitespace", "disable_additional_properties", "disable_fallback"):
        if not isinstance(so.get(opt, False), bool):
            raise APIError(f"`structured_outputs.{opt}` must be true or false", name)
    ws = so.get("whitespace_pattern")
    if ws is not None and not isinstance(ws, str):
        raise APIError("`structured_outputs.whitespace_pattern` must be a string (a regex)", name)
    kinds = [k for k in SO_KINDS if so.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise APIError(f"`structured_outputs` must hold exactly one of {', '.join(SO_KINDS)}; it has "
                       f"{len(kinds)}", name)
    kind = kinds[0]
    if kind == "json_object" and so[kind] is not True:
        raise APIError("`structured_outputs.json_object` must be true", name)
    spec = None if kind == "json_object" else _checked(name, kind, so[kind])
    schema = spec
    if kind == "json" and so.get("disable_additional_properties"):
        schema = _no_additional_properties(spec)
    return [Spec(name, kind, schema, whitespace_flexible=not so.get("disable_any_whitespace", False),
                 whitespace_pattern=ws)]


def _checked(name: str, kind: str, v: Any) -> Any:
    """The value of a constraint of `kind`, its type checked (a JSON schema may come as text, as vLLM takes it)."""
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise APIError(f"`{name}`: the JSON schema is not valid JSON: {str(e)[:200]}", name) from None
        if not isinstance(v, (dict, bool)):
            raise APIError(f"`{name}`: a JSON schema must be an object, got {type(v).__name__}", name)
        return v
    if kind == "choice":
        if not (isinstance(v, list) and v and all(isinstance(c, str) for c in v)):
            raise APIError(f"`{name}`: the choice must be a non-empty list of strings", name)
        return v
    if not isinstance(v, str) or not v:
        raise APIError(f"`{name}`: the {kind} must be a non-empty string", name)
    return v


def tool_schema(tools: list[dict], choice: str | dict) -> Any:
    """The JSON schema a forced tool choice constrains the answer to, as vLLM writes it: a named function's
    `parameters`; for "required", a non-empty array of {"name": one of the tools, "parameters": its parameters},
    the functions' `$defs` gathered at the top (one name defined twice differently: a 400)."""
    def params(t: dict) -> Any:
        p = t["function"].get("parameters")
        return p if p else {"type": "object", "properties": {}}
    if isinstance(choice, dict):
        return next(params(t) for t in tools if t["function"]["name"] == choice["function"]["name"])
    items = [{"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": params(t)},
              "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    defs: dict[str, Any] = {}
    for t in tools:
        for k, v in (params(t).get("$defs") or {}).items() if isinstance(params(t), dict) else ():
            if k in defs and defs[k] != v:
                raise APIError(f"`tools` define `$defs.{k[:40]}` twice, differently; rename one", "tools")
            defs[k] = v
    if defs:
        schema["$defs"] = defs
    return schema


def forced_tool_calls(content: str | None, forced: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of an answer constrained by a forced tool choice (`tool_schema`): for a named function
    the answer is its arguments; for "required", the JSON array of {"name", "parameters"}. The JSON value is read
    from the start of the answer (text after it, such as an EOS token's text under skip_special_tokens=false, is
    not part of it). A "required" answer that is not the JSON its grammar asked for (cut by max_tokens) stays
    content, with no calls; a named function's whole answer is then its arguments, as vLLM returns them."""
    from qwen35_lib.serve.parsers import tool_call

    text = content or ""
    try:
        calls, end = json.JSONDecoder().raw_decode(text.lstrip())
        value = text.lstrip()[:end]
    except ValueError:
        calls, value = None, None
    if forced != "required":
        return "", [tool_call(forced, text if value is None else value)]
    if value is None:
        return content, []
    if not isinstance(calls, list) or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        return content, []
    return "", [tool_call(c["name"], c.get("parameters", {})) for c in calls]


def _no_additional_properties(schema: Any) -> Any:
    """vLLM's disable_additional_properties: `additionalProperties: false` on every object schema that does not
    say (a copy; iterative, the depth already bounded by --max-json-depth)."""
    schema = json.loads(json.dumps(schema))
    todo = [schema]
    while todo:
        x = todo.pop()
        if isinstance(x, dict):
            if (x.get("type") == "object" or "properties" in x) and "additionalProperties" not in x:
                x["additionalProperties"] = False
            todo.extend(x.values())
        elif isinstance(x, list):
            todo.extend(x)
    return schema


class Grammars:
    """The server's grammar compiler: llguidance's view of the tokenizer (made on first use: ~1 s for a real
    vocabulary), and the last `cache_size` compiled grammars by spec (a grammar is shared; each request gets its own
    matcher from it). Thread-safe: requests are parsed on a pool of threads."""

    def __init__(self, text: Any, vocab_size: int, eos_ids, cache_size: int = 64):
        self.text, self.vocab_size, self.eos_ids, self.cache_size = text, vocab_size, tuple(eos_ids), cache_size
        self._vocab = None
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._lock = threading.Lock()

    def vocab(self):
        from qwen35_lib.engine.structured import GrammarVocabulary

        with self._lock:
            if self._vocab is None:
                self._vocab = GrammarVocabulary(self.text.tokenizer.to_str(), self.vocab_size, self.eos_ids)
            return self._vocab

    def compile(self, spec: Spec):
        """The compiled grammar of `spec` (cached), or a 400 naming its field with llguidance's reason."""
        if self.text is None:
            raise APIError(f"`{spec.param}`: structured outputs need a tokenizer (this server has none; start it with "
                           "--tokenizer DIR)", spec.param)
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            from qwen35_lib.engine.structured import compile_grammar

            grammar = compile_grammar(self.vocab(), spec.kind, spec.spec, whitespace_flexible=spec.whitespace_flexible,
                                      whitespace_pattern=spec.whitespace_pattern)
        except ValueError as e:
            raise APIError(f"`{spec.param}`: the {_what(spec.kind)} cannot be compiled: {str(e)[:500]}",
                           spec.param) from None
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return grammar


def reasoning_marker(text: Any, prompt: list[int]) -> tuple[int, ...] | None:
    """Under a reasoning parser, the token ids after which a grammar starts (`</think>`), or None when the prompt's
    reasoning is over already (its last `</think>` after its last `<think>`, as a template with thinking off writes
    it): vLLM's structured outputs leave the reasoning free and constrain the answer."""
    start, end = (tuple(text.tokenizer.encode(t, add_special_tokens=False).ids) for t in (THINK, END_THINK))
    last = lambda m: max((i for i in range(len(prompt) - len(m) + 1) if tuple(prompt[i:i + len(m)]) == m),
                         default=-1)
    return None if last(end) > last(start) else end


def _what(kind: str) -> str:
    return {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice list",
            "grammar": "grammar"}[kind]
