"""`python -m boost_jax.eval` and the lm-evaluation-harness adapter: the eval command's loss is the
training loop's at the same step, bits per byte count the evaluated text, another tokenizer is
refused by name, and the harness's three requests are answered from the model's own forward."""

import json
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from boost_jax import api, eval as boost_eval
from boost_jax.data.synthetic import write_synthetic
from boost_jax.launch.startup import PHASES
from boost_jax.model.harness import BoostLM
from boost_jax.runtime.errors import ConfigError, DataError
from boost_jax.training.evaluate import evaluate


@pytest.fixture(scope="module")
def run_dir(tiny_run_dir):
    """A cola run dir: 4 steps, evaluated and checkpointed at step 4."""
    return tiny_run_dir


def test_eval_is_the_training_loops_eval_at_that_step(run_dir):
    logged = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    got = evaluate(run_dir)
    assert got["step"] == 4 and got["loss"] == pytest.approx(logged["eval_loss"], rel=1e-6)
    assert got["bits_per_byte"] == pytest.approx(logged["eval_bpb"], rel=1e-6)
    # Bits per byte: the summed loss in bits over the bytes of the evaluated targets' text.
    assert got["bits_per_byte"] == pytest.approx(got["loss"] * got["tokens"] / (got["bytes"] * math.log(2)))
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]))


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_generate_until_batches_requests_asking_alike_with_each_answer_its_own(run_dir, monkeypatch):
    """Requests of two kinds (stop strings, max_gen_toks), interleaved, with prompts of different lengths,
    one so long that its continuation is cut to the model's context: decoded in batches of `rows` per
    kind, each answer equals the one the request gets alone."""
    lm = BoostLM(run_dir, batch_size=4)
    long = "import os\n" * 40  # more tokens than the context (64): kept to its last 63, 1 new token
    kinds = [{"until": ["\n\n"], "max_gen_toks": 12}, {"until": [")"], "max_gen_toks": 6, "do_sample": False}]
    contexts = ["def main(", "x = ", long, "class A:\n    def f(self", "import", "", "for i in range(3):\n"]
    asks = [request(c, kinds[i % 2]) for i, c in enumerate(contexts)]
    alone = [lm.generate_until([a])[0] for a in asks]
    calls = []
    generate = lm.decoder.generate
    monkeypatch.setattr(lm.decoder, "generate", lambda prompts, *a, **k: calls.append(len(prompts)) or
                        generate(prompts, *a, **k))
    assert lm.generate_until(asks) == alone
    assert calls == [4, 4]  # 4 and 3 requests of the two kinds, each one batch padded to the row count
    assert any(alone) and len(set(alone)) > 2


@pytest.mark.parametrize("layout", [
    ["parallel.tp=2", "parallel.dp=1"], pytest.param(["parallel.fsdp=2", "parallel.dp=1"], marks=pytest.mark.slow),
    pytest.param(["parallel.dp=2"], marks=pytest.mark.slow),
    pytest.param(["parallel.dp=2", "parallel.fsdp=2", "parallel.tp=2"], marks=pytest.mark.slow),
])
def test_eval_under_any_layout_equals_one_device(run_dir, layout):
    """The checkpoint, trained on one device, evaluated under tp, fsdp and dp: the same loss."""
    one = evaluate(run_dir, max_tokens=3000)
    other = evaluate(run_dir, layout, max_tokens=3000)
    assert other["tokens"] == one["tokens"] == 6 * 8 * 64 and other["loss"] == pytest.approx(one["loss"], rel=1e-5)


@pytest.mark.slow  # two fresh processes: ~30 s
def test_a_run_on_simulated_devices_is_evaluated_and_decoded_on_its_layout(tmp_path, tiny_overrides):
    from boost_jax.config import load_config
    from boost_jax.training.run import train

    run = tmp_path / "tp2"
    train(load_config(None, [*tiny_overrides, f"run_dir={run}", "train.steps=4", "checkpoint.every=4",
                             "train.eval_every=0", "parallel.tp=2", "parallel.dp=1", "parallel.cpu_devices=2"]),
          jax.devices()[:2])
    # A fresh process sees one CPU device unless the command simulates the run's parallel.cpu_devices.
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cli = lambda *args: subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, env=env, timeout=300)
    evaluated = cli("boost_jax.eval", str(run), "--json")
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["loss"] == pytest.approx(evaluate(run)["loss"], rel=1e-5)
    decoded = cli("boost_jax.generate", str(run), "--prompt", "def main(", "--max-new-tokens", "4", "--json")
    assert decoded.returncode == 0, decoded.stderr
    assert len(json.loads(decoded.stdout)["tokens"][0]) <= 4
    took = json.loads(decoded.stdout)["startup_s"]  # in a fresh process, each phase takes its time
    assert all(took[k] > 0 for k in ("import", "restore", "compile", "run")) and took["total"] == pytest.approx(sum(took[k] for k in PHASES), abs=0.01)


def test_eval_refuses_a_dataset_of_another_tokenizer(run_dir, tmp_path):
    write_synthetic(tmp_path / "other", [20000], 512)
    with pytest.raises(DataError, match=r"tokenizer does not match the run's \(.*run/tokenizer\.json\): .* use the "
                                        rf"run's dataset \(not {re.escape(str(tmp_path / 'other'))}\)"):
        evaluate(run_dir, ["data.source=prepared", f"data.path={tmp_path / 'other'}"], split="train")


def test_eval_cli_prints_json(run_dir, capsys):
    boost_eval.main([str(run_dir), "--split", "train", "--max-tokens", "600", "--json", "--timings"])
    out = capsys.readouterr()
    r = json.loads(out.out)
    assert r["split"] == "train" and r["tokens"] == 2 * 8 * 64 and r["bits_per_byte"] > 0  # whole batches
    took = r["startup_s"]  # the seconds to the loss, by phase (boost_jax/launch/startup.py)
    assert list(took) == [*PHASES, "total"] and took["run"] > 0 and took["total"] == pytest.approx(sum(
        took[k] for k in PHASES), abs=0.01)
    assert f"start-up: {took['total']:.2f} s to the loss = import {took['import']:.2f} + data" in out.err
    # The command applies the run's parallel.cpu_reuse_memory (here too late: this process's JAX has started).
    assert "parallel.cpu_reuse_memory=true has no effect: JAX's backend has started" in out.err


# ----------------------------------------------------------------------------- lm-evaluation-harness


@pytest.fixture(scope="module")
def harness(run_dir):
    return BoostLM(run_dir, batch_size=2)


def request(*args):
    return SimpleNamespace(args=args)


def forward_log_probs(lm, ids):
    logits = np.asarray(api.forward(lm.model, np.asarray([ids], np.int32)))[0]
    return jax.nn.log_softmax(logits, axis=-1)


def test_loglikelihood_is_the_forwards_sum_of_log_probs(harness):
    pairs = [("def main(", " return 1"), ("", "import os"), ("x = ", "[1, 2, 3]")]
    got = harness.loglikelihood([request(*p) for p in pairs])
    for (context, continuation), (score, greedy) in zip(pairs, got):
        prefix = harness.encode(context) if context else [harness.eos]
        whole = harness.encode(context + continuation) if context else prefix + harness.encode(continuation)
        lp = np.asarray(forward_log_probs(harness, whole[:-1]))
        n = len(whole) - len(prefix)
        rows = lp[len(whole) - 1 - n:]
        assert score == pytest.approx(float(rows[np.arange(n), whole[-n:]].sum()), rel=1e-5, abs=1e-4)
        assert greedy == bool((rows.argmax(-1) == np.asarray(whole[-n:])).all())
    # A continuation of the model's own greedy choices is greedy.
    ids = harness.encode("def main(")
    greedy_next = harness.tokenizer.decode([int(np.argmax(forward_log_probs(harness, ids)[-1]))])
    (_, is_greedy), = harness.loglikelihood([request("def main(", greedy_next)])
    assert is_greedy or harness.encode("def main(" + greedy_next)[:len(ids)] != ids  # unless the seam re-merges


def test_loglikelihood_reads_back_two_numbers_per_row(harness, monkeypatch):
    """Scored on the devices: each batch of `rows` sequences returns its sums and greedy flags, not the
    [rows, width, vocab] log-softmax (262 MB per batch of 8 at llama-60m, measured: docs/design.md section 11)."""
    scores, returned = harness._scores, []
    monkeypatch.setattr(harness, "_scores", lambda *a: returned.append(scores(*a)) or returned[-1])
    harness.loglikelihood([request("def main(", " return 1"), request("", "import os"), request("x = ", "[1]")])
    assert [[(x.shape, x.dtype) for x in out] for out in returned] == [[((2,), np.float32), ((2,), np.bool_)]] * 2


def test_rolling_loglikelihood_scores_every_token_once_in_windows(harness):
    text = "import os\nprint(os.path.join('a', 'b'))\n" * 12
    ids = [harness.eos, *harness.encode(text)]
    assert len(ids) > 2 * harness.context  # several windows of 64
    (got,) = harness.loglikelihood_rolling([request(text)])
    want, c = 0.0, harness.context
    for s in range(1, len(ids), c):
        e = min(s + c, len(ids))
        window = ids[max(0, e - c - 1):e]
        lp = np.asarray(forward_log_probs(harness, window[:-1]))
        want += float(lp[np.arange(len(window) - 1 - (e - s), len(window) - 1), window[-(e - s):]].sum())
    assert got == pytest.approx(want, rel=1e-5)


def test_generate_until_stops_at_the_first_stop_string(harness):
    (free,) = harness.generate_until([request("def main(", {"until": [], "max_gen_toks": 12})])
    stop = free[3:5] if len(free) >= 5 else free
    (cut,) = harness.generate_until([request("def main(", {"until": [stop], "max_gen_toks": 12})])
    assert cut == free[:free.find(stop)]


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
@pytest.mark.parametrize("layout", [
    ["parallel.tp=2", "parallel.dp=1"],
    pytest.param(["parallel.fsdp=2", "parallel.dp=1"], marks=pytest.mark.slow),
    pytest.param(["parallel.dp=2"], marks=pytest.mark.slow),
])
def test_the_harness_answers_the_same_on_any_layout(run_dir, harness, layout):
    """Trained on one device, served to the harness under tp, fsdp (weights sharded) or dp: the same
    scores (fp32, 1e-5) and the same greedy continuation as one device's."""
    on_mesh = BoostLM(run_dir, batch_size=3, overrides=" ".join(layout))  # as lm-eval's --model_args passes them
    assert on_mesh.rows % on_mesh.decoder.plan.size("batch") == 0
    pairs = [request("def main(", " return 1"), request("", "import os"), request("x = ", "[1, 2, 3]")]
    for (score, greedy), (want, want_greedy) in zip(on_mesh.loglikelihood(pairs), harness.loglikelihood(pairs)):
        assert score == pytest.approx(want, rel=1e-5, abs=1e-4) and greedy == want_greedy
    text = [request("import os\nprint(os.path.join('a', 'b'))\n" * 6)]
    assert on_mesh.loglikelihood_rolling(text) == pytest.approx(harness.loglikelihood_rolling(text), rel=1e-5)
    ask = [request("def main(", {"until": [], "max_gen_toks": 10})]
    assert on_mesh.generate_until(ask) == harness.generate_until(ask)


def test_the_harness_refuses_a_layout_decoding_cannot_run(run_dir):
    with pytest.raises(ConfigError, match="decoding runs without pipeline stages or context parallelism"):
        BoostLM(run_dir, overrides=["parallel.cp=2", "parallel.dp=1"])


def test_the_lm_eval_command_refuses_bad_input_by_name(run_dir, tmp_path):
    from boost_jax.lm_eval import main

    for argv, needle in [([str(tmp_path / "nope"), "--tasks", "x"], "run dir not found"),
                         ([str(run_dir), "--model", "hf", "--tasks", "x"], "--model: the model is RUN_DIR's"),
                         ([str(run_dir), "--step", "-1", "--tasks", "x"], "--step must be a checkpoint's step"),
                         ([str(run_dir), "model.d_model=8", "--tasks", "x"], "different model.d_model"),
                         ([str(run_dir), "parallel.tpp=2", "--tasks", "x"], "parallel.tpp"),
                         ([str(run_dir)], "--tasks is missing"),
                         ([str(run_dir), "--tasks", "x", "--include_path", str(tmp_path / "no")], "no such folder"),
                         ([str(run_dir), "--tasks", "x", "--limit", "-1"], "--limit must be a count"),
                         ([str(run_dir), "--tasks", "x", "--limit", "nan"], "--limit must be a count"),
                         ([str(run_dir), "--tasks", "x", "--batch_size", "0"], "--batch_size must be a whole number"),
                         ([str(run_dir), "--tasks", "x", "-b", "many"], "--batch_size must be a whole number"),
                         ([str(run_dir), "--tasks", "x", "parallel.pp=2"], "decoding runs without pipeline stages"),
                         ([str(run_dir), "--tasks", ""], "--tasks '': names no task"),
                         ([str(run_dir), "--tasks", "x", "--num_fewshot", "-1"], "--num_fewshot must be a count"),
                         ([str(run_dir), "--config", str(tmp_path / "no.yaml")], "no.yaml: no such file"),
                         ([str(run_dir), "--tasks", "x", "--output_path", str(run_dir / "config.yaml")],
                          "config.yaml is a file"),
                         ([str(run_dir), "--tasks", "x", "-o", str(run_dir / "config.yaml" / "r.json")],
                          "config.yaml is a file")]:
        with pytest.raises(SystemExit, match=needle):
            main(argv)


def test_results_count_as_saved_only_where_lm_eval_writes_them_and_only_new_ones(tmp_path):
    import time

    from boost_jax.lm_eval import saved_results

    started = time.time()
    (tmp_path / "out" / "boost_jax").mkdir(parents=True)
    assert saved_results(str(tmp_path / "out"), started) == []
    (tmp_path / "out" / "boost_jax" / "results_2026-12-07T06-00-00.json").write_text("{}")
    (tmp_path / "r_2026-12-07T06-00-00.json").write_text("{}")
    assert len(saved_results(str(tmp_path / "out"), started)) == 1
    assert len(saved_results(str(tmp_path / "r.json"), started)) == 1
    assert saved_results(str(tmp_path / "out"), time.time() + 10) == []  # written before this run: not its results
    (tmp_path / "out" / "boost_jax" / "results_2026-12-07T06-00-00.json").write_text('{"results": {"x"')
    assert saved_results(str(tmp_path / "out"), started) == []  # cut short by a full disk


def test_the_harness_refuses_a_model_argument_it_does_not_have(run_dir):
    with pytest.raises(ConfigError, match="no model argument 'overides'"):
        BoostLM(run_dir, overides="parallel.tp=2")
    with pytest.raises(ConfigError, match="--batch_size must be a whole number of rows, at least 1, got 'auto'"):
        BoostLM(run_dir, batch_size="auto")


@pytest.mark.slow  # lm-eval indexes its ~15,000 tasks: ~20 s
def test_the_lm_eval_command_names_a_task_lm_eval_does_not_have(run_dir):
    pytest.importorskip("lm_eval")
    proc = subprocess.run([sys.executable, "-m", "boost_jax.lm_eval", str(run_dir), "--tasks", "no_such_task"],
                          capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "--tasks: lm-eval has no task no_such_task" in proc.stderr


def test_the_harness_knows_the_model_by_name():
    registry = pytest.importorskip("lm_eval.api.registry")
    assert registry.get_model("boost_jax") is BoostLM


TASKS = {  # local lm-eval tasks over one JSON file, one per request type
    "boost_local_choice": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
                          "doc_to_target: '{{answer}}'\nmetric_list: [{metric: acc}]",
    "boost_local_rolling": "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\n"
                           "metric_list: [{metric: bits_per_byte}]",
    "boost_local_generate": "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{target}}'\n"
                            "generation_kwargs: {until: ['\\n\\n'], max_gen_toks: 8, do_sample: false}\n"
                            "metric_list: [{metric: exact_match}]",
}
DOCS = [{"question": "def main(", "choices": [" return 1", " pass", "x = 2"], "answer": 1,
         "text": "import os\nimport sys\n\ndef main():\n    return 0\n", "target": "\n"},
        {"question": "import", "choices": [" os", " sys", " re"], "answer": 0, "text": "class A:\n    pass\n",
         "target": " os"},
        {"question": "for i in", "choices": [" range(3):", " x:", " []:"], "answer": 0,
         "text": "x = [1, 2, 3]\nprint(x)\n", "target": " range"}]


@pytest.mark.slow  # lm-eval in a fresh process: ~60 s
def test_the_lm_eval_command_runs_local_tasks_of_every_request_type(run_dir, harness, tmp_path):
    """`python -m boost_jax.lm_eval RUN_DIR parallel.tp=2 ... --tasks ... --include_path DIR` end to end on
    local tasks (a JSON file, no network): each request's answer is the in-process model's, and the scores follow."""
    pytest.importorskip("lm_eval")
    (tmp_path / "data.json").write_text(json.dumps(DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, body in TASKS.items():
        (tasks / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs: {{data_files: "
                                            f"{{test: {tmp_path / 'data.json'}}}}}\ntest_split: test\n{body}\n")
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    # Served on tp=2 (two simulated devices) by the command's overrides, scored against one device in process.
    proc = subprocess.run([sys.executable, "-m", "boost_jax.lm_eval", str(run_dir), "parallel.cpu_devices=2",
                           "parallel.tp=2", "parallel.dp=1", "--tasks", ",".join(TASKS),
                           "--include_path", str(tasks), "--output_path", str(tmp_path / "out"), "--log_samples"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (out,) = (tmp_path / "out").iterdir()
    results = json.loads(next(out.glob("results_*.json")).read_text())["results"]
    samples = {name: [json.loads(line) for line in next(out.glob(f"samples_{name}_*.jsonl")).read_text().splitlines()]
               for name in TASKS}
    args = lambda sample: [tuple(a.values()) for a in sample["arguments"].values()]
    chosen = []
    for sample in sorted(samples["boost_local_choice"], key=lambda x: x["doc_id"]):
        want = harness.loglikelihood([request(*a) for a in args(sample)])
        got = [float(r[0][0]) for r in sample["resps"]]
        assert got == pytest.approx([w for w, _ in want], rel=1e-5, abs=1e-4)
        chosen.append(int(np.argmax(got)) == sample["doc"]["answer"])
    assert results["boost_local_choice"]["acc,none"] == pytest.approx(np.mean(chosen))
    texts = [d["text"] for d in DOCS]
    log_p = harness.loglikelihood_rolling([request(t) for t in texts])
    bits = -sum(log_p) / sum(len(t.encode()) for t in texts) / math.log(2)
    assert results["boost_local_rolling"]["bits_per_byte,none"] == pytest.approx(bits, rel=1e-5)
    for sample in samples["boost_local_generate"]:
        (context, kwargs), = args(sample)
        assert sample["resps"][0][0] == harness.generate_until([request(context, kwargs)])[0]


@pytest.fixture(scope="module")
def quality_tiny(cache_dir):
    """`bench quality`'s config at its cheapest: llama-tiny, 8 x 32 tokens a step (8 rows: the factored dense
    model trains on all 8 simulated devices), the runs' ~10 evals of one batch each, no health norms (most of
    a train step's compile, no part of the bench); with 2,560 tokens (the bench's floor of 10 steps) and 512
    validation tokens, one run takes seconds. The results page's figures come from `python -m boost_jax.bench
    quality` at its own sizes."""
    return ["model.preset=llama-tiny", "train.seq_len=32", "train.batch_size=8", "train.eval_batches=1",
            "log.health=false", "data.max_bytes=300000", f"data.cache_dir={cache_dir}"]


@pytest.mark.slow  # eight tiny training runs and their evals
def test_bench_quality_trains_evaluates_and_reports(tmp_path, quality_tiny):
    from boost_jax.bench import quality, quality_section  # the results page's section 6 without a study

    q = quality.measure(quality_tiny, 2560, 4, tmp_path / "work", 512, log=lambda s: None)
    assert [(r["arch"], r["budget"]) for r in q["runs"]] == [
        ("dense", "tokens"), ("svd", "tokens"), ("cola", "tokens"), ("lax", "tokens"), ("svd", "flops"), ("cola", "flops")]
    dense, cola_flops = q["runs"][0], q["runs"][-1]
    assert cola_flops["train_flops"] == pytest.approx(dense["train_flops"], rel=0.05) and cola_flops["steps"] > dense["steps"]
    assert all(r["curve"] and math.isfinite(r["final"]["perplexity"]) for r in q["runs"])
    assert [c["method"] for c in q["recovery"]] == ["svd", "whiten"]
    assert all(c["compressed"]["step"] == 0 and c["recovered"]["step"] == 4 for c in q["recovery"])
    lines = quality_section.quality_section(q)
    assert lines[0] == "## 6. Low-rank quality, measured" and any("cola at dense's FLOPs" in line for line in lines)
    factored = quality_section.factored_section(q)  # beside a study: the recovery table alone
    assert factored[0] == "## 6b. A trained dense model, factored" and not any("cola at" in line for line in factored)
    methods = [line.split(" | ")[0] for line in factored if line.startswith(("| svd |", "| whiten |"))]
    assert methods == ["| svd", "| whiten"]


def test_bench_quality_refuses_a_bad_optimizer_axis_by_name():
    from boost_jax.bench import quality

    for vary, lrs, config, needle in [("train.lr=1,2", "1e-3,3e-3,1e-2", [], "varies train.optimizer=A,B,... only"),
                                      ("train.optimizer=adamw,sgd2", "1e-3,3e-3,1e-2", [], "unknown optimizer 'sgd2'"),
                                      ("train.optimizer=muon", "1e-3,3e-3", [], "three positive learning rates"),
                                      ("train.optimizer=muon", "1e-3,x,1", [], "expected three numbers"),
                                      ("train.optimizer=muon", "1e-3,3e-3,1e-2", ["train.lr=1"], "train.lr=1: with --vary")]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            quality.vary_optimizers(vary, lrs, config)
    assert quality.vary_optimizers("train.optimizer=adamw,muon", "1e-3,3e-3,1e-2", []) == (["adamw", "muon"],
                                                                                          [1e-3, 3e-3, 1e-2])


def test_bench_quality_refuses_a_bad_model_axis_by_name():
    from boost_jax.bench import quality

    assert quality.vary_model_values("model.attn_latent_heads=1,2,4", ["train.lr=1e-3"]) == ("model.attn_latent_heads",
                                                                                            [1, 2, 4])
    assert quality.vary_model_values("model.attn_rope_dims=0,16", []) == ("model.attn_rope_dims", [0, 16])
    for vary, config, needle in [("model.attn_latent_heads=1,two", [], "expected whole numbers separated by commas"),
                                 ("model.attn_latent_heads=1,2", ["train.seed=3"], "train.seed=3: with --vary"),
                                 ("model.attn_rope_dims=0,16", ["model.attn_rope_dims=8"], "model.attn_rope_dims=8: with --vary"),
                                 ("model.d_model=64,128", [], "bench quality varies train.optimizer or one of")]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            quality.vary_model_values(vary, config)


@pytest.mark.slow  # four tiny training runs and their evals
def test_bench_quality_compares_a_model_key_over_seeds(tmp_path, quality_tiny):
    """Issue 74's comparison: decoupled RoPE (2 of llama-tiny's 8 dims per head) against none, two seeds
    each (`--seeds N` takes any count: the table's columns are the rows' seeds)."""
    from boost_jax.bench import quality

    o = quality.compare_model_values(quality_tiny, "model.attn_rope_dims", [0, 2], 2560, tmp_path / "work", 512,
                                     log=lambda s: None)
    assert [r["attn_rope_dims"] for r in o["rows"]] == [0, 2]
    assert o["rows"][1]["params"] > o["rows"][0]["params"]  # the rotary keys' own projection
    for r in o["rows"]:
        assert r["seed_losses"][1] != r["seed_losses"][0] and r["spread"] == abs(r["seed_losses"][0] - r["seed_losses"][1])
    lines = quality.model_values_table(o)
    assert lines[0].startswith("| rotary dims d_r | params | seed 0 / seed 1 |")
    assert [line.split(" | ")[0] for line in lines[2:]] == ["| 0", "| 2"]


@pytest.mark.slow  # six tiny training runs and their evals
@pytest.mark.long  # 40 s; in the default run: bench quality's runs, report and --vary over seeds (around it)
def test_bench_quality_compares_optimizers_at_their_best_rate_over_two_seeds(tmp_path, quality_tiny):
    """Two rates a grid here (the command asks three: vary_optimizers above), so that each optimizer's best
    is picked from a grid and run again on a second seed in six runs, not eight."""
    from boost_jax.bench import quality, quality_section  # the results page's section 6 without a study

    o = quality.compare_optimizers(quality_tiny, ["adamw", "muon"], [1e-3, 1e-2], 2560, tmp_path / "work", 512,
                                   archs=("cola",), log=lambda s: None)
    assert [(r["arch"], r["optimizer"]) for r in o["rows"]] == [("cola", "adamw"), ("cola", "muon")]
    for r in o["rows"]:
        losses = [g["loss"] for g in r["grid"]]
        assert r["best_lr"] == r["grid"][losses.index(min(losses))]["lr"] and r["seed_losses"][0] == min(losses)
        assert r["seed_losses"][1] != r["seed_losses"][0]  # another seed: another run
        assert (tmp_path / "work" / f"cola-{r['optimizer']}-lr{r['best_lr']}-seed1" / "metrics.jsonl").is_file()
    lines = quality_section.optimizers_section({"optimizers": o, "command": "python -m boost_jax.bench quality --vary ..."})
    assert lines[0].startswith("## 6b.") and sum(line.startswith("| cola |") for line in lines) == 2
    assert quality_section.optimizer_costs_section({"optimizers": o}) == []  # beside a study: the step times alone, none here
