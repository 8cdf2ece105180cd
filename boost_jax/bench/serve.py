"""`bench serve [CONFIG.yaml] [section.key=value ...] [--requests 32] [--reps 3] [--max-s 900] [--soak-s S] [--json]`:
the server's speed under many clients, beside the same requests one at a time and `api.generate`
(with --soak-s: its memory and pages over a soak of S seconds instead, bench/serve_soak.py).

For the config's model (random weights of its shape; default llama-mini cola, one device, context
train.seq_len=256, serve.slots=32) it starts `python -m boost_jax.serve`'s app (serving/api.py over an
Engine, every program compiled first) on a loopback port, with a tokenizer of one word per token id
(random weights have no text), and sends --requests greedy completions of mixed lengths (prompts of
8 to 3/8 of the context, 8 to 1/4 of it new tokens, a seeded draw) as token-id prompts through the
`openai` client, streamed, from a process of their own (bench/serve_clients.py). After an untimed
round of them all, side by side, --reps times in turn (the machine's noise hits all alike):
all at once (concurrent clients), the same one at a time (each sent when the one before ended), and
`api.generate` on all of them as one padded batch (to the longest's new tokens; its useful tokens
are each request's own). Reported: output tokens/s (wall, first request sent to last token), time to
first token and time between tokens (p50 / p99, over every request's streamed chunks) and the
ratios; checked: every request's text is the same all three ways (greedy is exact), the server
compiled nothing while serving and every cache page is back. Bounded: --max-s for the whole
measurement (each client times out within it). Exits 1 on a failed check.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time

import jax
import numpy as np
from flax import nnx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from boost_jax import api
from boost_jax.bench import serve_soak
from boost_jax.bench.common import config_of, parse, parser
from boost_jax.config import Config, ConfigError
from boost_jax.model import Model
from boost_jax.parallel import make_plan
from boost_jax.parallel.mesh import mesh_devices
from boost_jax.runtime.cli import a_share, at_least, positive
from boost_jax.serving.engine import Engine
from boost_jax.serving.listen import bind

DEFAULTS = ["model.preset=llama-mini", "model.arch=cola", "parallel.dp=1", "train.seq_len=256", "serve.slots=32"]
MODEL_NAME = "bench"
HOW = ("concurrent", "one_at_a_time", "padded_batch")


def mixed_requests(n: int, vocab: int, context: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """`n` (prompt ids, max_tokens): prompts of 8 .. 3/8 of the context, 8 .. 1/4 of it new tokens."""
    rng = np.random.default_rng(seed)
    top_prompt, top_new = max(9, context * 3 // 8), max(9, context // 4)
    return [(rng.integers(3, vocab, int(rng.integers(8, top_prompt))).tolist(), int(rng.integers(8, top_new)))
            for _ in range(n)]


def word_tokenizer(vocab: int):
    """A tokenizer of one word per id ("t0" .. "t{vocab-1}", joined by spaces): text for random weights."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    return tok


class LoopbackServer:
    """The serve app on 127.0.0.1 (a free port) in a thread of its own, the engine stepping in another."""

    def __init__(self, server):
        import uvicorn  # optional: the serve extra

        from boost_jax.serving.api import create_app  # optional: fastapi, the serve extra

        self.server, self.sock = server, bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.uv = uvicorn.Server(uvicorn.Config(create_app(server), log_level="warning"))
        self.thread = threading.Thread(target=self.uv.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.server.engine.start()
        self.thread.start()
        while not self.uv.started:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.uv.should_exit = True
        self.thread.join()
        self.server.engine.stop()
        self.sock.close()


def run_clients(url: str, requests: list, together: bool, max_s: float) -> dict:
    """bench/serve_clients.py in a process of its own: its wall seconds and each request's chunks."""
    args = {"url": url, "model": MODEL_NAME, "requests": requests, "together": together, "max_s": max_s}
    out = subprocess.run([sys.executable, "-m", "boost_jax.bench.serve_clients", json.dumps(args)],
                         capture_output=True, text=True, timeout=max_s + 60, check=False)
    if out.returncode:
        raise RuntimeError(f"bench serve: its clients failed (exit {out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50_ms": None, "p99_ms": None}
    q = np.percentile(np.array(values) * 1e3, [50, 99])
    return {"p50_ms": float(q[0]), "p99_ms": float(q[1])}


def served(results: list[dict], seconds: float) -> dict:
    """Tokens/s (all requests' tokens over the wall time), time to first token and between tokens (a
    chunk of k tokens streamed together: its wait spread over them, k values of wait / k)."""
    tokens = sum(r["tokens"] for r in results)
    first = [r["times"][0] - r["sent"] for r in results if r["times"]]
    between = [(b - a) / k for r in results for a, b, k in zip(r["times"], r["times"][1:], r["counts"][1:])
               for _ in range(k)]
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "ttft": _percentiles(first), "tbt": _percentiles(between)}


def start_engine(cfg: Config, cache: str):
    """The config's model (random weights), its plan, and an Engine of it with every program compiled."""
    model = Model(cfg.model, rngs=nnx.Rngs(cfg.train.seed))
    plan = make_plan(cfg, mesh_devices(cfg.parallel))
    engine = Engine(model, plan, cfg.serve, cache=cache, eos_id=None, context=cfg.train.seq_len)
    engine.warm_up()
    return model, plan, engine


def loopback(cfg: Config, engine) -> LoopbackServer:
    from boost_jax.serving.api import Server  # optional: fastapi, the serve extra

    return LoopbackServer(Server(engine, word_tokenizer(cfg.model.vocab_size), model_name=MODEL_NAME, serve=cfg.serve))


def measure(cfg: Config, n_requests: int, reps: int, max_s: float, cache: str) -> dict:
    t_start = time.perf_counter()
    deadline = t_start + max_s
    model, plan, engine = start_engine(cfg, cache)
    warm_up_s = time.perf_counter() - t_start
    context, compiled = cfg.train.seq_len, engine.compilations
    requests = mixed_requests(n_requests, cfg.model.vocab_size, context)
    prompts, longest = [p for p, _ in requests], max(n for _, n in requests)
    generate = lambda: api.generate(model, prompts, max_new_tokens=longest, plan=plan, cache=engine.kind, max_len=context)
    generate()  # compiles its programs
    useful = sum(n for _, n in requests)
    runs, differ = {how: [] for how in HOW}, 0  # differ: completions whose text is not api.generate's
    with loopback(cfg, engine) as loop:
        tok = loop.server.tok
        want = [tok.decode(out[:n]) for out, (_, n) in zip(generate(), requests)]
        run_clients(loop.url, requests, True, max_s)  # untimed: the server's first calls
        for _ in range(reps):
            for how in HOW:
                if time.perf_counter() > deadline:
                    raise ConfigError(f"bench serve: past --max-s={max_s:g} s; lower --reps or --requests")
                t0 = time.perf_counter()
                if how == "padded_batch":
                    outs, seconds = generate(), time.perf_counter() - t0
                    runs[how].append({"seconds": seconds, "tokens": useful, "tokens_per_s": useful / seconds})
                    got = [tok.decode(out[:n]) for out, (_, n) in zip(outs, requests)]
                else:
                    out = run_clients(loop.url, requests, how == "concurrent", deadline - time.perf_counter())
                    runs[how].append(served(out["results"], out["seconds"]))
                    got = [r["text"] for r in out["results"]]
                differ += sum(g != w for g, w in zip(got, want))
    checks = {"completions_not_as_generate": differ, "compilations_while_serving": engine.compilations - compiled,
              "pages_used_after": engine.pages.used}
    median = {how: statistics.median(r["tokens_per_s"] for r in runs[how]) for how in HOW}
    return {"model": cfg.model.preset, "arch": cfg.model.arch, "cache": engine.kind,
            "device": jax.devices()[0].device_kind, "devices": plan.mesh.size, "context": context,
            "serve": {k: getattr(cfg.serve, k) for k in ("slots", "page_tokens", "prefill_chunk", "prefill_rows",
                                                          "decode_steps", "buckets")},
            "programs": engine.programs, "warm_up_s": warm_up_s, "requests": n_requests, "reps": reps,
            "prompt_tokens": [min(len(p) for p, _ in requests), max(len(p) for p, _ in requests)],
            "new_tokens": [min(n for _, n in requests), max(n for _, n in requests)], "useful_tokens": useful,
            "runs": runs, "median_tokens_per_s": median,
            "concurrent_over_one_at_a_time": median["concurrent"] / median["one_at_a_time"],
            "concurrent_over_padded_batch": median["concurrent"] / median["padded_batch"],
            "checks": checks, "ok": not any(checks.values()),
            "seconds": time.perf_counter() - t_start}


def table(r: dict) -> list[str]:
    """Markdown: each way's median tokens/s, its ratio to the concurrent one, its latencies (of the median rep)."""
    lines = [("| how | output tokens/s (median) | concurrent / this | time to first token p50 / p99 ms | "
              "time between tokens p50 / p99 ms |"), "|---|---|---|---|---|"]
    names = {"concurrent": f"{r['requests']} clients at once", "one_at_a_time": "one at a time",
             "padded_batch": f"`api.generate`, all {r['requests']} as one padded batch"}
    ms = lambda d: f"{d['p50_ms']:.0f} / {d['p99_ms']:.0f}" if d["p50_ms"] is not None else "-"
    for how in HOW:
        runs = sorted(r["runs"][how], key=lambda x: x["tokens_per_s"])
        mid = runs[len(runs) // 2]
        rate = r["median_tokens_per_s"][how]
        latency = (ms(mid["ttft"]), ms(mid["tbt"])) if "ttft" in mid else ("-", "-")
        lines.append(f"| {names[how]} | {rate:,.1f} | {r['median_tokens_per_s']['concurrent'] / rate:.2f} | "
                     f"{latency[0]} | {latency[1]} |")
    return lines


def main(argv: list[str]) -> None:
    p = parser("python -m boost_jax.bench serve", __doc__)
    p.add_argument("--requests", type=int, default=32, help="completions sent, of mixed prompt and output lengths")
    p.add_argument("--reps", type=int, default=3, help="times each way runs, in turn")
    p.add_argument("--max-s", type=float, default=900.0, help="the bound on the whole measurement, seconds")
    p.add_argument("--cache", default="auto", help="the KV cache kind paged (as serve's --cache)")
    p.add_argument("--soak-s", type=float, default=0.0, help="instead: the soak of bench/serve_soak.py, this many seconds")
    p.add_argument("--soak-warmup", type=float, default=0.2, help="the share of the soak before its bounds apply")
    p.add_argument("--rss-bound", type=float, default=0.05, help="the soak's RSS growth allowed past its warm-up")
    a = parse(p, argv)
    at_least(a, requests=1, reps=1, soak_s=0)
    positive(a, "max_s", "rss_bound")
    a_share(a, "soak_warmup", "the soak")
    cfg = config_of([*DEFAULTS, *a.config], decoding=True)
    command = " ".join(["python -m boost_jax.bench serve", *argv])
    if a.soak_s:
        _, _, engine = start_engine(cfg, a.cache)
        requests = mixed_requests(a.requests, cfg.model.vocab_size, cfg.train.seq_len)
        with loopback(cfg, engine) as loop:
            result = {"command": command, **serve_soak.soak(loop, engine, requests, a.soak_s, a.soak_warmup, a.rss_bound)}
        summary = (f"{command}: {result['requests']} requests ({result['cancelled']} cancelled), RSS "
                   f"{result['after_warmup']['rss_mib']:.0f} -> {result['end']['rss_mib']:.0f} MiB "
                   f"({100 * result['growth']['rss']:+.1f}%), peak pages {result['peak_pages_used']}; {result['flat']}")
    else:
        result = {**measure(cfg, a.requests, a.reps, a.max_s, a.cache), "command": command}
        summary = "\n".join([
            (f"{command}: {result['model']} {result['arch']}, cache {result['cache']}, {result['devices']} device(s), "
             f"{result['programs']} programs compiled in {result['warm_up_s']:.0f} s"), *table(result),
            (f"concurrent / one at a time {result['concurrent_over_one_at_a_time']:.2f}x, concurrent / padded batch "
             f"{result['concurrent_over_padded_batch']:.2f}x; checks: {result['checks']}")])
    print(json.dumps(result) if a.json else summary)
    if not result["ok"]:
        sys.exit(f"bench serve: a check failed: {result.get('checks', result.get('flat'))}")
