"""`python -m qwen35_lib.bench serve --base-url URL`: the playbook's workloads against any OpenAI-compatible server
(ours, vLLM, sglang), streamed, measured as `vllm bench serve` measures them and reported under its names.

For each workload (`--workloads`, scaled by `--scale`) and each `--concurrency` C (InferenceX conventions):
1. draw 10 x C requests (`--num-prompts` to change it) with `workloads.draw_requests`: input and output lengths
   uniform in [ceil(r L), L], prompt ids uniform in [2, --vocab-size), seeded; the prompts go out as token ids
   (vLLM's completions endpoint takes them too), with max_tokens = the drawn output length, EOS ignored, greedy;
2. send `--num-warmups` requests (default 2 x C) first, untimed;
3. send all requests with at most C in flight (`--max-concurrency`, vLLM's name, is the same option), at
   `--request-rate` requests per second (inf: all at once; else Poisson arrivals, or gamma with `--burstiness`, as
   vLLM draws them), each streamed with `include_usage`, to the completions endpoint (token-id prompts) or the chat
   endpoint (`--endpoint /v1/chat/completions` or `--backend openai-chat`: the prompt ids as text, decoded by
   `--tokenizer DIR` when given, else one word per id); per request: TTFT (first token), ITL (each gap between two
   chunks with tokens), E2EL (whole request), TPOT ((E2EL - TTFT) / (output tokens - 1));
4. report mean / median / std and the `--metric-percentiles` (99) of each in ms, request, output and total token
   throughput over the run's duration, and with `--goodput ttft:MS tpot:MS e2el:MS` the requests per second that
   met every bound (`request_goodput`), under `vllm bench serve --save-result`'s keys; with `--save-result` (in
   `--result-dir`, default .) or `--result-dir`, one such file per run (with the metadata `workload`, `scale`,
   `concurrency`, `--metadata KEY=VALUE`), which `python -m qwen35_lib recipe --result FILE` reads.
vllm bench serve's random dataset (`--dataset-name random --random-input-len I --random-output-len O
--random-range-ratio R`) replaces the workloads with its lengths, uniform in [int(L (1 - R)), int(L (1 + R))].
A progress bar goes to stderr; `--plot PATH` draws TTFT, TPOT and output throughput against concurrency. A run in
which any request failed makes the command exit non-zero (after writing what it measured), naming the first error.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import pathlib
import sys
import time

import numpy as np

from qwen35_lib.bench import workloads

DESCRIPTION = "the playbook's workloads against an OpenAI-compatible server (vllm bench serve's metrics)"
PERCENTILES = (99,)


CHAT = "/v1/chat/completions"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", help="the server, e.g. http://127.0.0.1:8000 (default: http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1", help="the server's host when no --base-url (%(default)s)")
    p.add_argument("--port", type=int, default=8000, help="the server's port when no --base-url (%(default)s)")
    p.add_argument("--endpoint", default=None, help="/v1/completions (default) or /v1/chat/completions")
    p.add_argument("--backend", choices=("openai", "vllm", "openai-chat"), default=None,
                   help="openai or vllm: the completions endpoint; openai-chat: the chat endpoint")
    p.add_argument("--model", help="the model to ask for (default: the first of GET /v1/models)")
    p.add_argument("--served-model-name", help="vllm bench serve's name for --model")
    p.add_argument("--tokenizer", metavar="DIR", help="a tokenizer.json folder: chat prompts are the prompt ids "
                                                      "decoded by it (default: one word per id)")
    p.add_argument("--workloads", default="1k/1k", help="comma-separated workload names (default: %(default)s; "
                                                       "all: 8k/1k,1k/8k,1k/1k)")
    p.add_argument("--scale", default=None, help="length factor (default: the CPU scale of data/workloads.json, "
                                                 "1/16; 1 for the published lengths)")
    p.add_argument("--dataset-name", choices=("random",), help="vllm bench serve's dataset: random (the "
                   "lengths of --random-input-len, --random-output-len, --random-range-ratio, in place of --workloads)")
    p.add_argument("--random-input-len", type=_positive, metavar="N", help="random dataset: prompt length (1024)")
    p.add_argument("--random-output-len", type=_positive, metavar="N", help="random dataset: output length (128)")
    p.add_argument("--random-range-ratio", type=float, metavar="R", help="random dataset: lengths uniform in "
                   "[int(L (1 - R)), int(L (1 + R))], as vLLM draws them (0)")
    p.add_argument("--trust-remote-code", action="store_true", help="accepted (vLLM's flag): nothing is loaded here")
    p.add_argument("--concurrency", "--max-concurrency", type=_positive, nargs="+", default=[1, 8], metavar="N",
                   dest="concurrency", help="requests in flight at most, one run each (default: 1 8)")
    p.add_argument("--request-rate", type=_rate, default=float("inf"), metavar="R",
                   help="requests per second (default inf: all at once, bounded by the concurrency)")
    p.add_argument("--burstiness", type=_positive_float, default=1.0,
                   help="gamma shape of the arrivals at --request-rate (1: Poisson, as vLLM)")
    p.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                   help="SLOs (ttft, tpot, e2el in ms): request_goodput counts the requests that met all of them")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics whose percentiles are reported (default: %(default)s)")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles (default: 99)")
    p.add_argument("--num-prompts", type=_positive, help="requests per run (default: 10 x concurrency)")
    p.add_argument("--num-warmups", type=int, help="untimed requests before each run (default: 2 x concurrency)")
    p.add_argument("--vocab-size", type=_positive, default=256,
                   help="prompt ids are drawn from [2, N) (default 256: valid for every model here, tiny included)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take (default 600)")
    p.add_argument("--result-dir", help="also write one vllm-bench-serve-style result file per run here")
    p.add_argument("--save-result", action="store_true", help="write the result files (in --result-dir, default .)")
    p.add_argument("--result-filename", help="the file name of the result (a run's tag is added when there are "
                                            "several runs)")
    p.add_argument("--metadata", nargs="+", metavar="KEY=VALUE", default=[], help="added to each result")
    p.add_argument("--label", help="the result's backend label")
    p.add_argument("--ignore-eos", action="store_true", help="accepted: EOS is always ignored here (vLLM's flag)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar (vLLM's name for --no-progress)")
    p.add_argument("--save-detailed", action="store_true",
                   help="keep per-request figures and outputs (token ids) in the JSON")
    p.add_argument("--plot", metavar="PATH", help="a PNG of TTFT, TPOT and throughput against concurrency")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _rate(value: str) -> float:
    x = float(value)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0 (inf: all at once)")
    return x


def _positive_float(value: str) -> float:
    x = float(value)
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"{value} must be a finite number > 0")
    return x


GOODPUT_KEYS = ("ttft", "tpot", "e2el")


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """`--goodput ttft:500 tpot:50` as {"ttft": 500.0, ...} (ms), refused in one line when malformed."""
    out = {}
    for item in items or ():
        key, _, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if key not in GOODPUT_KEYS or not ms >= 0:
            raise ValueError(f"--goodput {item!r}: give KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)} and MS >= 0")
        out[key] = ms
    return out


def _positive(value: str) -> int:
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} must be at least 1")
    return n


@dataclasses.dataclass
class Output:
    """One request as the client saw it."""

    prompt_len: int
    success: bool = False
    error: str = ""
    ttft: float = 0.0  # s
    latency: float = 0.0  # s
    itl: list[float] = dataclasses.field(default_factory=list)  # s, between chunks with tokens
    output_tokens: int = 0
    token_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    start: float = 0.0  # perf_counter at send


async def send(client, url: str, model: str, prompt: list[int], max_tokens: int, timeout: float,
               chat_text: str | None = None) -> Output:
    """One streamed completion (or chat completion, with `chat_text` as the user message): its timings, tokens and
    text (`token_ids` when the server sends them)."""
    out = Output(len(prompt))
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True,
                stream_options={"include_usage": True})
    if chat_text is not None:
        body = {k: v for k, v in body.items() if k != "prompt"} | dict(
            messages=[{"role": "user", "content": chat_text}], max_completion_tokens=max_tokens)
    out.start = last = time.perf_counter()
    usage = None
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                doc = json.loads(data)
                if "error" in doc:
                    out.error = str(doc["error"])[:300]
                    return out
                usage = doc.get("usage") or usage
                for c in doc.get("choices", []):
                    ids = c.get("token_ids") or []
                    piece = (c.get("delta") or {}).get("content") or "" if chat_text is not None else \
                        c.get("text") or ""
                    if not ids and not piece:
                        continue
                    now = time.perf_counter()
                    if not out.token_ids and not out.text:
                        out.ttft = now - out.start
                    else:
                        out.itl.append(now - last)
                    last = now
                    out.token_ids += ids
                    out.text += piece
    except Exception as e:  # noqa: BLE001 - a failed request is counted, not fatal
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.latency = time.perf_counter() - out.start
    out.output_tokens = (usage or {}).get("completion_tokens") or len(out.token_ids) or len(out.itl) + 1
    out.success = True
    return out


async def run_batch(base: str, endpoint: str, model: str, requests: list[tuple[list[int], int]], concurrency: int,
                    timeout: float, progress: bool, label: str, rate: float = float("inf"), burstiness: float = 1.0,
                    seed: int = 0, chat_texts: list[str] | None = None) -> tuple[list[Output], float]:
    """All requests with at most `concurrency` in flight, sent at `rate` per second (gamma arrivals of shape
    `burstiness`, mean 1 / rate, as vLLM; inf: at once); (outputs in request order, wall seconds)."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    sem = asyncio.Semaphore(concurrency)
    done = [0]
    bar = _Bar(len(requests), label) if progress else None

    async with httpx.AsyncClient(base_url=base, limits=limits, timeout=timeout) as client:
        rng = np.random.default_rng(seed)
        gaps = np.zeros(len(requests)) if rate == float("inf") else \
            rng.gamma(burstiness, 1.0 / (rate * burstiness), size=len(requests))
        at = np.cumsum(gaps) - gaps[0] if len(gaps) else gaps  # the first request goes at once

        async def one(i, prompt, n):
            await asyncio.sleep(max(0.0, start + at[i] - time.perf_counter()))
            async with sem:
                o = await send(client, endpoint, model, prompt, n, timeout,
                               chat_texts[i] if chat_texts is not None else None)
            done[0] += 1
            if bar:
                bar.update(done[0])
            return o

        start = time.perf_counter()
        outs = await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(requests)))
        duration = time.perf_counter() - start
    if bar:
        bar.close()
    return list(outs), duration


class _Bar:
    """A text progress bar on stderr (tqdm when present)."""

    def __init__(self, total: int, label: str):
        try:
            from tqdm import tqdm

            self.tqdm = tqdm(total=total, desc=label, file=sys.stderr, leave=False)
        except ImportError:
            self.tqdm = None
        self.total, self.label = total, label

    def update(self, n: int) -> None:
        if self.tqdm is not None:
            self.tqdm.update(n - self.tqdm.n)
        else:
            print(f"\r{self.label} {n}/{self.total}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.tqdm is not None:
            self.tqdm.close()
        else:
            print(file=sys.stderr)


def metrics(outs: list[Output], duration: float, goodput: dict[str, float] | None = None,
            percentiles: tuple[float, ...] = PERCENTILES, which: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")
            ) -> dict:
    """`vllm bench serve`'s result keys from the outputs of one run (`request_goodput` with SLOs in ms)."""
    ok = [o for o in outs if o.success]
    ms = lambda xs: np.asarray(xs, np.float64) * 1000 if len(xs) else np.zeros(1)
    ttft = ms([o.ttft for o in ok])
    tpot = ms([(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1])
    itl = ms([x for o in ok for x in o.itl])
    e2el = ms([o.latency for o in ok])
    total_in, total_out = sum(o.prompt_len for o in ok), sum(o.output_tokens for o in ok)
    doc = dict(duration=duration, completed=len(ok), failed=len(outs) - len(ok), total_input_tokens=total_in,
               total_output_tokens=total_out, request_throughput=len(ok) / duration,
               output_throughput=total_out / duration, total_token_throughput=(total_in + total_out) / duration,
               max_output_tokens_per_s=_peak_output_rate(ok))
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        doc[f"mean_{name}_ms"] = float(np.mean(xs))
        doc[f"median_{name}_ms"] = float(np.median(xs))
        doc[f"std_{name}_ms"] = float(np.std(xs))
        for p in (percentiles if name in which else ()):
            doc[f"p{p:g}_{name}_ms"] = float(np.percentile(xs, p))
    if goodput:
        def good(o: Output) -> bool:
            tpot_ms = (o.latency - o.ttft) / (o.output_tokens - 1) * 1000 if o.output_tokens > 1 else 0.0
            got = {"ttft": o.ttft * 1000, "tpot": tpot_ms, "e2el": o.latency * 1000}
            return all(got[k] <= v for k, v in goodput.items())

        doc["request_goodput"] = sum(good(o) for o in ok) / duration
    return doc


def _peak_output_rate(ok: list[Output]) -> float:
    """The most output tokens finished in any one second of the run (vLLM's max_output_tokens_per_s)."""
    stamps = []
    for o in ok:
        t = o.start + o.ttft
        stamps.append(t)
        for gap in o.itl:
            t += gap
            stamps.append(t)
    if not stamps:
        return 0.0
    sec = np.floor(np.asarray(stamps) - min(stamps)).astype(int)
    return float(np.bincount(sec).max())


def first_model(base: str) -> str:
    import httpx

    r = httpx.get(base.rstrip("/") + "/v1/models", timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _chat_texts(prompts: list[list[int]], tokenizer: str | None) -> list[str]:
    """The chat endpoint's user messages for token-id prompts: decoded by the tokenizer, or one word per id."""
    if tokenizer:
        from qwen35_lib.text import load_text

        text = load_text(tokenizer)
        return [text.decode(p) for p in prompts]
    return [" ".join(f"w{t}" for t in p) for p in prompts]


def _options(args: argparse.Namespace) -> tuple[str, dict, tuple, tuple, dict]:
    """The flags that need parsing: (endpoint, goodput, percentiles, the metrics they apply to, metadata)."""
    endpoint = args.endpoint or (CHAT if args.backend == "openai-chat" else "/v1/completions")
    if endpoint not in ("/v1/completions", CHAT):
        raise ValueError(f"--endpoint {endpoint}: give /v1/completions or {CHAT}")
    goodput = parse_goodput(args.goodput)
    try:
        percentiles = tuple(float(x) for x in args.metric_percentiles.split(","))
    except ValueError:
        raise ValueError(f"--metric-percentiles {args.metric_percentiles!r}: give numbers, e.g. 50,90,99") from None
    which = tuple(x.strip() for x in args.percentile_metrics.split(","))
    meta = {}
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--metadata {item!r}: give KEY=VALUE")
        meta[key] = value
    return endpoint, goodput, percentiles, which, meta


def _workloads(args: argparse.Namespace) -> tuple[list[str], list]:
    """(names, workloads): vllm's random dataset when its flags are given, else the named workloads, scaled."""
    random = random_dataset(args)
    if random is not None:
        return [random.name], [random]
    names = workloads.parse_names(args.workloads) if args.workloads != "all" else list(workloads.load())
    scale = args.scale if args.scale is not None else workloads.cpu_scale()
    return names, [workloads.scaled(name, scale) for name in names]


def run(args: argparse.Namespace) -> dict:
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    endpoint, goodput, percentiles, which, meta = _options(args)
    chat = endpoint == CHAT
    result_dir = args.result_dir or ("." if args.save_result or args.result_filename else None)
    args.model = args.model or args.served_model_name
    try:
        model = args.model or first_model(base)
    except Exception as e:  # noqa: BLE001 - one line naming the server
        raise ValueError(f"--base-url {base}: cannot list its models ({type(e).__name__}: {e}); is the server "
                         "up?") from None
    names, ws = _workloads(args)
    runs = []
    for name, w in zip(names, ws):
        for conc in args.concurrency:
            n = args.num_prompts or 10 * conc
            warm = 2 * conc if args.num_warmups is None else args.num_warmups
            reqs = workloads.draw_requests(w, n + warm, seed=args.seed, vocab_size=args.vocab_size)
            label = f"{name} x{conc}"
            texts = _chat_texts([p for p, _ in reqs], args.tokenizer) if chat else None
            if warm:
                asyncio.run(run_batch(base, endpoint, model, reqs[n:], conc, args.timeout, False, label,
                                      chat_texts=texts[n:] if texts else None))
            outs, duration = asyncio.run(run_batch(base, endpoint, model, reqs[:n], conc, args.timeout,
                                                   not (args.no_progress or args.disable_tqdm), label,
                                                   args.request_rate, args.burstiness, args.seed,
                                                   texts[:n] if texts else None))
            rate = "inf" if args.request_rate == float("inf") else args.request_rate
            doc = dict(date=datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
                       backend=args.label or args.backend or ("openai-chat" if chat else "openai"),
                       endpoint=endpoint, base_url=base, model_id=model, num_prompts=n, num_warmups=warm,
                       request_rate=rate, burstiness=args.burstiness, max_concurrency=conc, workload=name,
                       scale=w.scale, concurrency=conc, input_range=list(w.bounds(w.input_len)),
                       output_range=list(w.bounds(w.output_len))) | meta | \
                metrics(outs, duration, goodput, percentiles, which)
            runs.append(_finish(doc, outs, reqs[:n], goodput, args.save_detailed))
            if result_dir:
                _write_result(result_dir, doc, args.result_filename,
                              several=len(names) * len(args.concurrency) > 1)
    print(format_table(runs))
    if args.plot:
        plot(runs, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    out = dict(benchmark="serve", base_url=base, model=model, runs=runs)
    failed = sum(r["failed"] for r in runs)
    if failed:  # the caller (bench's main) writes the results, then exits non-zero
        first = next(r["errors"][0] for r in runs if r.get("errors"))
        print(f"error: bench serve: {failed} of {sum(r['num_prompts'] for r in runs)} requests failed (first: "
              f"{first[:300]})", file=sys.stderr)
        out["exit_status"] = 1
    return out


def _finish(doc: dict, outs: list, reqs: list, goodput: dict, detailed: bool) -> dict:
    """A run's record with its goodput targets, its first errors and (`detailed`) every request's lengths,
    latencies, texts and tokens."""
    if goodput:
        doc["goodput"] = goodput
    errors = sorted({o.error for o in outs if not o.success})
    if errors:
        doc["errors"] = errors[:5]
    if detailed:
        doc |= dict(input_lens=[o.prompt_len for o in outs], output_lens=[o.output_tokens for o in outs],
                    ttfts=[o.ttft for o in outs], itls=[o.itl for o in outs],
                    generated_texts=[o.text for o in outs], token_ids=[o.token_ids for o in outs],
                    prompts=[p for p, _ in reqs], max_tokens=[m for _, m in reqs])
    return doc


def random_dataset(args: argparse.Namespace) -> workloads.RandomLengths | None:
    """The random dataset's lengths when any of its flags is given (vLLM's defaults for the rest), else None."""
    given = [f for f in ("dataset_name", "random_input_len", "random_output_len", "random_range_ratio")
             if getattr(args, f, None) is not None]
    if not given:
        return None
    r = 0.0 if args.random_range_ratio is None else args.random_range_ratio
    if not 0 <= r < 1:
        raise ValueError(f"--random-range-ratio {r}: give a number in [0, 1)")
    i, o = args.random_input_len or 1024, args.random_output_len or 128
    return workloads.RandomLengths(f"random_{i}_{o}", i, o, r)


def _write_result(folder: str, doc: dict, filename: str | None = None, several: bool = False) -> pathlib.Path:
    tag = f"qwen35_{doc['workload'].replace('/', '')}_conc{doc['concurrency']}" + \
        ("" if doc["scale"] == "1" else f"_scale{doc['scale'].replace('/', '-')}")
    if filename:
        stem = filename[:-5] if filename.endswith(".json") else filename
        tag = f"{stem}_{tag}" if several else stem
    path = pathlib.Path(folder) / f"{tag}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1))
    return path


def format_table(runs: list[dict]) -> str:
    head = (f"{'workload':>9} {'conc':>5} {'done':>5} {'fail':>4} {'req/s':>7} {'out tok/s':>10} {'tot tok/s':>10} "
            f"{'TTFT ms':>9} {'p99':>8} {'TPOT ms':>8} {'p99':>8} {'ITL ms':>8} {'p99':>8} {'E2EL ms':>9}")
    lines = [head]
    for r in runs:
        lines.append(f"{r['workload']:>9} {r['concurrency']:>5} {r['completed']:>5} {r['failed']:>4} "
                     f"{r['request_throughput']:>7.2f} {r['output_throughput']:>10.1f} "
                     f"{r['total_token_throughput']:>10.1f} {r['median_ttft_ms']:>9.1f} {r['p99_ttft_ms']:>8.1f} "
                     f"{r['median_tpot_ms']:>8.1f} {r['p99_tpot_ms']:>8.1f} {r['median_itl_ms']:>8.1f} "
                     f"{r['p99_itl_ms']:>8.1f} {r['median_e2el_ms']:>9.1f}")
    return "\n".join(lines)


def plot(runs: list[dict], path: str) -> None:
    """Median TTFT, median TPOT and output throughput against concurrency, one line per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name in dict.fromkeys(r["workload"] for r in runs):
        rs = [r for r in runs if r["workload"] == name]
        c = [r["concurrency"] for r in rs]
        for ax, key in zip(axes, ("median_ttft_ms", "median_tpot_ms", "output_throughput")):
            ax.plot(c, [r[key] for r in rs], marker="o", label=name)
    for ax, title in zip(axes, ("median TTFT (ms)", "median TPOT (ms)", "output throughput (tokens/s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
