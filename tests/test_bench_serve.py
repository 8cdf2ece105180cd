"""`bench serve` (bench/serve.py) on a tiny case: the server on loopback under concurrent openai
clients, one at a time and api.generate's padded batch give the same greedy texts; its figures add
up (tokens over seconds, percentiles in order); bad flags are refused before any model is built."""

import pytest

from boost_jax.bench import serve, serve_soak
from boost_jax.config import ConfigError, from_args


@pytest.mark.slow  # a server, 8 streamed clients three ways
def test_bench_serve_on_a_tiny_case_is_self_consistent():
    cfg = from_args([*serve.DEFAULTS, "model.preset=llama-tiny", "train.seq_len=64", "serve.slots=4",
                     "serve.page_tokens=8", "serve.buckets=1", "serve.decode_steps=4"])
    r = serve.measure(cfg, n_requests=8, reps=1, max_s=300, cache="auto")
    assert r["checks"] == {"completions_not_as_generate": 0, "compilations_while_serving": 0, "pages_used_after": 0}
    assert r["ok"] and r["programs"] == 2 and r["useful_tokens"] >= 8 * 8  # each request 8 or more new tokens
    for how in serve.HOW:
        run = r["runs"][how][0]
        assert run["tokens"] == r["useful_tokens"]  # every request got its max_tokens (no <eos>: eos_id None)
        assert run["tokens_per_s"] == pytest.approx(run["tokens"] / run["seconds"])
        assert r["median_tokens_per_s"][how] == run["tokens_per_s"]
    for how in ("concurrent", "one_at_a_time"):
        run = r["runs"][how][0]
        for latency in (run["ttft"], run["tbt"]):
            assert 0 <= latency["p50_ms"] <= latency["p99_ms"] <= run["seconds"] * 1e3
    ratio = r["median_tokens_per_s"]["concurrent"] / r["median_tokens_per_s"]["one_at_a_time"]
    assert r["concurrent_over_one_at_a_time"] == pytest.approx(ratio)
    table = serve.table(r)
    assert len(table) == 2 + len(serve.HOW) and table[2].startswith("| 8 clients at once | ")


@pytest.mark.parametrize("argv, needle", [
    (["--requests", "0"], "--requests must be at least 1, got 0"),
    (["--reps", "0"], "--reps must be at least 1, got 0"),
    (["--max-s", "0"], "--max-s must be a finite number above 0, got 0.0"),
    (["--soak-warmup", "1"], "--soak-warmup must be a share of the soak"),
    (["serve.slots=0"], "serve.slots"),
])
def test_bench_serve_refuses_bad_flags_and_config_before_any_model(argv, needle):
    with pytest.raises(ConfigError, match=needle):
        serve.main(argv)


@pytest.mark.slow  # a server under 8 looping clients for 10 seconds
def test_bench_serve_soak_leaves_no_page_and_no_request_behind():
    cfg = from_args([*serve.DEFAULTS, "model.preset=llama-tiny", "train.seq_len=64", "serve.slots=4",
                     "serve.page_tokens=8", "serve.buckets=1", "serve.decode_steps=2"])
    _, _, engine = serve.start_engine(cfg, "auto")
    with serve.loopback(cfg, engine) as loop:
        r = serve_soak.soak(loop, engine, serve.mixed_requests(8, cfg.model.vocab_size, 64), 10.0, 0.2, 0.05)
    assert r["flat"]["no_page_leaked"] and r["flat"]["nothing_left_running"]
    assert r["requests"]["done"] > 0 and r["requests"]["cut"] > 0 and r["cancelled"] > 0
    assert r["peak_pages_used"] > 0 and len(r["samples"]) >= 8
