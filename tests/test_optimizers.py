"""train.optimizer: AdamW as before, Muon per layer on every decoder matrix, Spectron's bounded factor-pair updates."""

import json
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from boost_jax.config import ConfigError, load_config
from boost_jax.model.weights import init_params
from boost_jax.training.optimizers import factor_pairs, labels, lr_schedule, make_optimizer, shape_scale, top_singular


def tiny(*extra):
    return load_config(None, ["model.preset=llama-tiny", "train.warmup_steps=0", *extra])


def fake_grads(params, seed):
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return tree.unflatten([jax.random.normal(k, x.shape, x.dtype) * 0.01 for k, x in zip(keys, leaves)])


def run_updates(tx, params, steps=2):
    """The updates of `steps` successive steps on seeded gradients, applied as the train step does."""
    state, out = tx.init(params), []
    for i in range(steps):
        updates, state = jax.jit(tx.update)(fake_grads(params, i), state, params)
        params = optax.apply_updates(params, updates)
        out.append(updates)
    return out


def test_adamw_is_bitwise_the_previous_optimizer():
    cfg = tiny("model.arch=cola")
    params = init_params(cfg)
    t = cfg.train
    mask = jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key != "scale", params)
    before = optax.chain(optax.clip_by_global_norm(t.grad_clip),
                         optax.adamw(lr_schedule(t), b1=t.b1, b2=t.b2, weight_decay=t.weight_decay, mask=mask))
    for ours, theirs in zip(run_updates(make_optimizer(t, params), params), run_updates(before, params)):
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)))


@pytest.mark.parametrize("arch", ["cola", pytest.param("dense", marks=pytest.mark.slow)])
def test_muon_on_stacked_layers_equals_muon_on_each_layer_alone(arch):
    """Every decoder matrix (each factor of each layer) is orthogonalised alone: the update equals optax's
    Muon run on that layer's 2-D matrices; embedding, head and norms take the plain AdamW update."""
    cfg = tiny(f"model.arch={arch}", "train.optimizer=muon", "train.grad_clip=0")
    params, t = init_params(cfg), cfg.train
    ours = run_updates(make_optimizer(t, params), params)
    adamw = run_updates(make_optimizer(tiny(f"model.arch={arch}", "train.grad_clip=0").train, params), params)
    group = labels(params)
    matrices = {k: v for k, v in params["layers"].items() if k in ("attn", "mlp")}
    assert {g for g in jax.tree.leaves(group["layers"]["attn"]) + jax.tree.leaves(group["layers"]["mlp"])} == {"matrix"}
    assert group["embed"] == group["lm_head"]["w"] == group["layers"]["attn_norm"]["scale"] == "adamw"
    for layer in range(cfg.model.n_layers):
        one = lambda tree: jax.tree.map(lambda x: x[layer], tree)  # this layer's 2-D matrices
        muon = optax.contrib.muon(lr_schedule(t), ns_steps=t.muon.ns_steps, beta=t.muon.momentum,
                                  weight_decay=t.weight_decay, consistent_rms=t.muon.consistent_rms)
        state, p = muon.init(one(matrices)), one(matrices)
        for step in range(2):
            g = one({k: v for k, v in fake_grads(params, step)["layers"].items() if k in ("attn", "mlp")})
            expected, state = jax.jit(muon.update)(g, state, p)
            got = one({k: v for k, v in ours[step]["layers"].items() if k in ("attn", "mlp")})
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
            # the reference's parameters move by its own updates, as ours do
            p = optax.apply_updates(p, expected)
    for step in range(2):
        rest = lambda u: [u["embed"], u["lm_head"]["w"], u["final_norm"]["scale"], u["layers"]["attn_norm"]["scale"]]
        for a, b in zip(rest(ours[step]), rest(adamw[step])):
            np.testing.assert_array_equal(a, b)


def test_power_iteration_finds_the_largest_singular_value():
    m = jax.random.normal(jax.random.key(0), (3, 40, 8))
    sigma, _ = top_singular(m, jnp.full((3, 8), 8 ** -0.5), 200)
    np.testing.assert_allclose(sigma, [np.linalg.norm(np.asarray(x), 2) for x in m], rtol=1e-5)


@pytest.mark.parametrize("layout", [pytest.param(["parallel.fsdp=2", "parallel.dp=2"], id="fsdp2-dp2"),
                                    pytest.param(["parallel.tp=2"], id="tp2", marks=pytest.mark.slow)])
def test_no_collective_of_spectrons_update_runs_inside_a_loop(layout):
    """A while loop of collectives runs asynchronously on XLA's CPU runtime, which then starts the
    collectives after it beside its later iterations, in an order that differs by device: fsdp=2 x
    dp=2 deadlocked (issue 62). The power iterations are unrolled, so every collective is the step's own."""
    from boost_jax.analysis.hlo import collectives
    from boost_jax.analysis.program import build, optimizer_state
    from boost_jax.training.muon_layout import placements

    cfg = tiny("model.arch=cola", "train.optimizer=spectron", "train.muon.comm=gather", "train.batch_size=4",
               "train.seq_len=32", *layout)
    prog = build(cfg)
    tx = make_optimizer(cfg.train, prog.params, placements(cfg, prog.plan), split=True)
    compiled = jax.jit(tx.update).lower(prog.params, optimizer_state(prog, tx), prog.params).compile()
    found = collectives(compiled.as_text())
    assert found and not [c.name for c in found if c.loop_depth > 0]


def spectron_losses(tiny_overrides, run_dir, devices, *extra):
    """The losses of 4 spectron steps of llama-mini (where the deadlock showed; llama-tiny's did not) on `devices`."""
    from boost_jax.training.run import train

    cfg = load_config(None, [*tiny_overrides, f"run_dir={run_dir}", "train.steps=4", "checkpoint.every=0",
                             "train.eval_every=0", "model.arch=cola", "train.optimizer=spectron",
                             "train.muon.comm=gather", "model.preset=llama-mini", *extra])
    return train(cfg, devices)["losses"]


@pytest.mark.slow
@pytest.mark.long  # 30 s; in the default run: spectron at dp2 x fsdp2 equals one device (test_optimizer_layouts.py)
def test_spectron_on_fsdp2_x_dp2_trains_as_one_device_does(tiny_overrides, tmp_path):
    """The layout that deadlocked in 5 of 6 runs at llama-mini (XLA aborts the process): it ends with one
    device's losses. One run (a deadlock's cause, a collective in a loop, is pinned for every compile
    by test_no_collective_of_spectrons_update_runs_inside_a_loop)."""
    one = spectron_losses(tiny_overrides, tmp_path / "one", jax.devices()[:1], "parallel.dp=1")
    split = spectron_losses(tiny_overrides, tmp_path / "split", jax.devices()[:4], "parallel.fsdp=2", "parallel.dp=2")
    np.testing.assert_allclose(split, one, rtol=1e-5)


def test_spectron_bounds_the_products_update_where_muon_does_not():
    """dA B + A dB has at most the spectral norm Muon gives a dense d_in x d_out update (lr x c x the
    orthogonalised factors' norm), whatever the factors' scale; Muon's per-factor update grows with it."""
    cfg_of = lambda opt: tiny("model.arch=cola", f"train.optimizer={opt}", "train.grad_clip=0",
                              "train.spectron.power_steps=300", "train.weight_decay=0")
    params = init_params(cfg_of("spectron"))
    params["layers"] = jax.tree.map(lambda x: x * 20.0 if x.ndim == 3 else x, params["layers"])  # large factors
    t = cfg_of("spectron").train
    (spectron,) = run_updates(make_optimizer(t, params), params, steps=1)
    (muon,) = run_updates(make_optimizer(cfg_of("muon").train, params), params, steps=1)
    lr = float(lr_schedule(t)(0))
    pairs, muon_pairs = factor_pairs(spectron), factor_pairs(muon)
    assert len(pairs) == 7
    for path, pair in factor_pairs(params).items():
        for layer in range(cfg_of("muon").model.n_layers):
            a, b = (np.asarray(pair[k][layer], np.float64) for k in ("a", "b"))
            da, db = (np.asarray(pairs[path][k][layer], np.float64) for k in ("a", "b"))
            spectral = lambda x: np.linalg.norm(x, 2)
            c = shape_scale(a.shape[0], b.shape[1], t.muon.consistent_rms)
            # the factors' updates are Muon's directions, both scaled by c / (sigma(A) + sigma(B))
            s = c / (spectral(a) + spectral(b))
            ma, mb = (np.asarray(muon_pairs[path][k][layer], np.float64) for k in ("a", "b"))
            for ours, theirs, shape in ((da, ma, a.shape), (db, mb, b.shape)):
                np.testing.assert_allclose(ours, theirs / shape_scale(*shape, t.muon.consistent_rms) * s,
                                           rtol=2e-4, atol=1e-9)
            o_norm = max(spectral(da), spectral(db)) / (lr * s)  # the orthogonalised factors' norm
            bound = lr * c * o_norm
            assert spectral(da @ b + a @ db) <= bound * (1 + 1e-4)
            assert spectral(ma @ b + a @ mb) > 3 * bound  # what spectron prevents


@pytest.mark.parametrize("override, needle", [
    ("train.optimizer=sgd2", "train.optimizer: 'sgd2' is not one of"),
    ("train.muon.momentum=0", "train.muon.momentum: must be in (0, 1)"),
    ("train.muon.momentum=-0.9", "train.muon.momentum: must be in (0, 1)"),
    ("train.muon.momentum=.nan", "train.muon.momentum: expected a finite number"),
    ("train.muon.momentum=.inf", "train.muon.momentum: expected a finite number"),
    ("train.muon.ns_steps=0", "train.muon.ns_steps: must be >= 1"),
    ("train.muon.ns_coeffs=[3.4, -4.7]", "train.muon.ns_coeffs: must hold 3 values"),
    ("train.muon.consistent_rms=0", "train.muon.consistent_rms: must be > 0"),
    ("train.spectron.power_steps=0", "train.spectron.power_steps: must be >= 1"),
    ("train.muon.momentm=0.9", "unknown config key 'train.muon.momentm'"),
])
def test_bad_optimizer_settings_name_the_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)


def test_spectron_needs_factor_pairs_and_the_command_exits_1_with_nothing_written(tmp_path):
    with pytest.raises(ConfigError, match="train.optimizer: spectron renormalises low-rank factor pairs: arch dense"):
        load_config(None, ["model.arch=dense", "train.optimizer=spectron"])
    proc = subprocess.run([sys.executable, "-m", "boost_jax.train", "train.muon.ns_steps=0"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 1 and "train.muon.ns_steps" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_per_step_coefficients_are_read_as_triples():
    from optax.contrib._muon import orthogonalize_via_newton_schulz

    from boost_jax.training.optimizers import LAYER_MATRIX, newton_schulz

    steps = [[3.0, -4.0, 2.0], [2.5, -3.0, 1.5]]
    cfg = tiny("train.optimizer=muon", "train.muon.ns_steps=2", f"train.muon.ns_coeffs={sum(steps, [])}")
    x = jax.random.normal(jax.random.key(0), (2, 64, 16))
    got, _ = newton_schulz(cfg.train.muon, {}).update({"layers": {"w": x}}, optax.EmptyState())
    ns = lambda coeffs: orthogonalize_via_newton_schulz(x, jnp.asarray(coeffs), 2, dimension_numbers=LAYER_MATRIX)
    np.testing.assert_array_equal(got["layers"]["w"], ns(steps))  # iteration i takes triple i
    assert not np.allclose(ns(steps), ns(steps[0]))  # not the first triple twice


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
@pytest.mark.parametrize("optimizer", ["spectron", pytest.param("muon", marks=pytest.mark.slow)])
def test_the_optimizer_state_resumes_bitwise_and_a_switch_needs_reset_optimizer(tmp_path, tiny_overrides, capsys,
                                                                                optimizer):
    from boost_jax.training.run import train

    def run(name, steps, *extra):
        cfg = load_config(None, [*tiny_overrides, f"run_dir={tmp_path / name}", f"train.steps={steps}",
                                 "train.schedule_steps=6", "checkpoint.every=2", "train.eval_every=0",
                                 "parallel.dp=1", "model.arch=cola", f"train.optimizer={optimizer}", *extra])
        return train(cfg, jax.devices()[:1])

    full = run("split", 4)["losses"]
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "4")  # as if stopped after step 2's save
    resumed = run("split", 4)
    assert resumed["start_step"] == 2 and resumed["losses"] == full[2:]  # bitwise: the state came back
    other = "muon" if optimizer == "spectron" else "adamw"
    before = sorted(str(p) for p in (tmp_path / "split").rglob("*"))
    with pytest.raises(ConfigError, match=f"train.optimizer: run_dir .* was trained with '{optimizer}', now '{other}'.*"
                                          "train.reset_optimizer=true"):
        run("split", 6, f"train.optimizer={other}")
    (tmp_path / "split" / "config.yaml").rename(tmp_path / "config.yaml")  # the checkpoint's own record refuses too
    with pytest.raises(ConfigError, match=f"train.optimizer: checkpoint step 4 .* was trained with '{optimizer}'"):
        run("split", 6, f"train.optimizer={other}")
    (tmp_path / "config.yaml").rename(tmp_path / "split" / "config.yaml")
    assert sorted(str(p) for p in (tmp_path / "split").rglob("*")) == before
    capsys.readouterr()
    switched = run("split", 6, f"train.optimizer={other}", "train.reset_optimizer=true")
    assert switched["start_step"] == 4 and len(switched["losses"]) == 2
    out = capsys.readouterr()
    lines = [l for l in (out.out + out.err).splitlines() if "reset_optimizer" in l]
    assert len(lines) == 1 and f"train.optimizer {optimizer} -> {other}" in lines[0], lines


@pytest.mark.slow  # three training processes
@pytest.mark.long  # 40 s; in the default run: kill -9 (test_long_runs.py) and spectron's state resumed bitwise (above)
def test_kill_9_resumes_the_spectron_state_exactly(tiny_overrides, tmp_path):
    """As tests/test_long_runs.py does for AdamW (which also stops a run by SIGTERM): killed mid-run, then
    run to the end; the metrics are the uninterrupted run's, bit for bit."""
    from test_long_runs import metrics, run_cli, run_to_end, wait_for_step

    args = ["train.steps=12", "checkpoint.every=1", "checkpoint.keep=2", "model.arch=cola", "train.optimizer=spectron"]
    run_to_end(tmp_path / "one", tiny_overrides, *args)
    proc = run_cli(tmp_path / "run", tiny_overrides, *args)
    wait_for_step(tmp_path / "run", 5, proc)  # the first rows on disk (log.every=5)
    proc.kill()
    proc.communicate(timeout=300)
    assert "resumed from step" in run_to_end(tmp_path / "run", tiny_overrides, *args)
    assert [r["loss"] for r in metrics(tmp_path / "run")] == [r["loss"] for r in metrics(tmp_path / "one")]


@pytest.mark.parametrize("optimizer, preset, tp", [
    pytest.param(opt, preset, tp, marks=() if preset == "llama-tiny" or (preset, opt) == ("llama-7b", "muon") else pytest.mark.slow)
    for opt in ("adamw", "muon", "spectron") for preset, tp in (("llama-tiny", 2), ("llama-60m", 2), ("llama-7b", 4))])
def test_the_memory_model_counts_the_optimizer_state_as_compiled(optimizer, preset, tp):
    """AdamW: two fp32 moments per parameter; muon: one per decoder matrix (two for the rest); spectron
    adds an [L, r] vector per factor. The model matches the compiled init's per-device output (tp x
    fsdp2; llama-7b compiled on abstract inputs: nothing allocated)."""
    from boost_jax.analysis.memory_model import breakdown, param_elems
    from boost_jax.analysis.program import build
    from boost_jax.bench.memory import compiled_optimizer_bytes
    from boost_jax.parallel import abstract_plan

    cfg = load_config(None, [f"model.preset={preset}", "model.arch=cola", f"train.optimizer={optimizer}",
                             f"parallel.tp={tp}", "parallel.fsdp=2", "parallel.dp=1", "train.batch_size=4",
                             "train.seq_len=32"])
    modelled, compiled = breakdown(cfg)["optimizer"], compiled_optimizer_bytes(build(cfg))
    assert 0 <= compiled - modelled < 0.01 * modelled  # XLA adds its output tuple's table of buffer pointers
    two_moments = 2 * 4 * param_elems(cfg, abstract_plan(cfg))
    if optimizer == "adamw":
        assert modelled == two_moments + 2 * 4  # and two int32 counters (Adam's, the schedule's)
    else:  # the decoder matrices keep one moment instead of two (llama-tiny: 0.83 x AdamW's bytes)
        assert 0.5 * two_moments < modelled < 0.9 * two_moments


def test_the_planner_prices_the_newton_schulz_gemms():
    from flax import nnx

    from boost_jax.config.hardware import load_hardware, ring_seconds
    from boost_jax.model.weights import abstract_model
    from boost_jax.parallel import abstract_plan
    from boost_jax.planner.price import _analytic_parts
    from boost_jax.training.muon_layout import chosen_ways
    from boost_jax.training.optimizers import newton_schulz_flops

    cfg = tiny("model.arch=cola", "train.optimizer=muon", "parallel.tp=2", "parallel.dp=1")
    params = nnx.to_pure_dict(abstract_model(cfg)[1])
    # q's A of each layer: 64 x 16, so k = 16, K = 64: 5 iterations of 4 k^2 K + 2 k^3
    only_q_a = {"layers": {"attn": {"q": {"a": params["layers"]["attn"]["q"]["a"]}}}}
    assert newton_schulz_flops(cfg.train, only_q_a) == 2 * 5 * (4 * 16 * 16 * 64 + 2 * 16 ** 3)
    assert newton_schulz_flops(tiny("model.arch=cola").train, params) == 0
    hw = next(iter(load_hardware().values()))
    adamw = _analytic_parts(tiny("model.arch=cola", "parallel.tp=2", "parallel.dp=1"), hw, 1000)["optimizer"]
    muon = _analytic_parts(cfg, hw, 1000)["optimizer"]
    # each factor the way the run orthogonalises it (llama-tiny at tp=2: gathered, every rank iterating
    # on the whole factor at the fp32 (TF32) rate, half the bf16 peak), plus that gather
    chosen = chosen_ways(cfg, abstract_plan(cfg), hw.gpus_per_node)
    assert {w.name for w in chosen.values()} == {"gather"}
    flops = newton_schulz_flops(cfg.train, params) / (hw.peak_flops / 2 * hw.gemm_efficiency)
    gathers = sum(ring_seconds("all-gather", 2, w.bytes, False, hw) for w in chosen.values())
    assert muon - adamw == pytest.approx(flops + gathers, rel=1e-9) and flops > 0


def test_health_reports_the_factor_spectra_and_the_products_stable_rank():
    from boost_jax.training.health import health_norms

    cfg = tiny("model.arch=cola")
    params = init_params(cfg)
    updates = fake_grads(params, 3)
    order = [1, 0]  # a pipeline's storage order: layer 1 is stored first
    health = jax.jit(lambda p, u: health_norms(u, p, u, order))(params, updates)
    spectral = lambda x: np.linalg.norm(np.asarray(x, np.float64), 2)
    for stored, layer in enumerate(order):
        for group, names in (("attn", "qkvo"), ("mlp", ("gate", "up", "down"))):
            pairs = [params["layers"][group][n] for n in names]
            steps = [updates["layers"][group][n] for n in names]
            at = f"layer_{layer:02d}/{group}"
            want = {
                "spectral_a": max(spectral(p["a"][stored]) for p in pairs),
                "spectral_b": max(spectral(p["b"][stored]) for p in pairs),
                "update_spectral_a": max(spectral(u["a"][stored]) for u in steps),
                "update_spectral_b": max(spectral(u["b"][stored]) for u in steps),
                "stable_rank": min(np.linalg.norm(w := np.asarray(p["a"][stored] @ p["b"][stored], np.float64)) ** 2
                                   / spectral(w) ** 2 for p in pairs),
            }
            for kind, value in want.items():  # 100 power iterations from a fixed start
                assert float(health[f"{kind}/{at}"]) == pytest.approx(value, rel=1e-3), (kind, at)
    assert not any(k.startswith("spectral_a/") for k in health_norms(*[init_params(tiny("model.arch=dense"))] * 3, [0, 1]))


@pytest.mark.slow  # out of the inner tier (its 180 s budget); the full suite runs it
def test_health_takes_a_latent_heads_b_as_its_block_diagonal_matrix():
    """k's and v's B with latent heads: the spectra and the stable rank are those of the dense
    block-diagonal B the stacked blocks stand for (the stacked matrix's sigma only bounds its largest
    block's from above, and its B B^T holds cross terms that are no part of the matrix)."""
    from boost_jax.model.latent_heads import dense_b
    from boost_jax.training.health import health_norms
    from boost_jax.training.optimizers import latent_head_blocks

    cfg = tiny("model.arch=cola", "model.attn_latent_heads=2", "model.n_kv_heads=2")
    params, blocks = init_params(cfg), latent_head_blocks(cfg.model)
    updates = fake_grads(params, 3)
    got = {name: jax.jit(lambda p, u, b=b: health_norms(u, p, u, [0, 1], b))(params, updates)
           for name, b in (("blocks", blocks), ("stacked", {}))}
    spectral = lambda x: np.linalg.norm(np.asarray(x, np.float64), 2)
    dense = lambda b, name: dense_b(np.asarray(b, np.float64), 2) if name in "kv" else np.asarray(b, np.float64)
    pairs = {n: params["layers"]["attn"][n] for n in "qkvo"}
    steps = {n: updates["layers"]["attn"][n] for n in "qkvo"}
    for layer in (0, 1):
        want = {"spectral_b": max(spectral(dense(p["b"][layer], n)) for n, p in pairs.items()),
                "update_spectral_b": max(spectral(dense(u["b"][layer], n)) for n, u in steps.items()),
                "stable_rank": min(np.linalg.norm(w := np.asarray(p["a"][layer], np.float64) @ dense(p["b"][layer], n))
                                   ** 2 / spectral(w) ** 2 for n, p in pairs.items())}
        for kind, value in want.items():
            assert float(got["blocks"][f"{kind}/layer_{layer:02d}/attn"]) == pytest.approx(value, rel=1e-3), kind
        # the stacked matrices' figures are not the block-diagonal B's
        assert any(float(got["stacked"][f"{kind}/layer_{layer:02d}/attn"]) != pytest.approx(value, rel=1e-3)
                   for kind, value in want.items())


@pytest.mark.slow  # a training process; the health norms stay in the inner loop in-process above
def test_training_on_a_tp_mesh_with_health_ends(tmp_path, tiny_overrides):
    """`train` of 4 layers under tp=4 with the health metrics (the factor spectra included, in the
    step's cond, taken at step 3 only): it ends, and logs them. A QR there once deadlocked XLA's CPU
    runtime in this very command; a fresh process, so that a hang fails by timeout."""
    args = [*tiny_overrides, f"run_dir={tmp_path}", "parallel.cpu_devices=4", "parallel.tp=4", "parallel.dp=1",
            "model.n_layers=4", "train.steps=3", "checkpoint.every=0", "train.eval_every=0", "log.health=true"]
    out = subprocess.run([sys.executable, "-m", "boost_jax.train", *args], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 3 and 1 <= rows[-1]["stable_rank/layer_00/attn"] <= 16  # r = 16


@pytest.mark.slow  # two benchmark runs of each optimizer
def test_bench_step_puts_each_optimizers_added_time_beside_its_newton_schulz_prediction(capsys, monkeypatch):
    from boost_jax.bench import step
    from boost_jax.launch.peaks import measure_matmul_peak

    # The same probe at a size that takes milliseconds, not the 2 x 11 2048^3 matmuls of the benchmark;
    # without the health norms, most of the step's compile (the overheads compared leave them out alike).
    monkeypatch.setattr(step, "measure_matmul_peak", lambda dtype: measure_matmul_peak(dtype, n=256, reps=2))
    step.main(["model.preset=llama-tiny", "model.arch=cola", "parallel.dp=1", "train.batch_size=4", "train.seq_len=32",
               "log.health=false",
               "--vary", "train.optimizer=adamw,muon", "--reps", "1", "--steps", "1", "--json"])
    adamw, muon = json.loads(capsys.readouterr().out)["results"]
    assert adamw["newton_schulz_flops"] == 0 and muon["newton_schulz_flops"] > 0
    assert muon["optimizer_overhead_s"] == pytest.approx(muon["median_step_s"] - adamw["median_step_s"])
    assert muon["predicted_optimizer_overhead_s"] == pytest.approx(muon["newton_schulz_flops"] / adamw["model_flops_per_s"])


def optimizer_collectives(*overrides):
    """The collectives of the optimizer's update alone, compiled as the train step lays out its state."""
    from boost_jax.analysis.hlo import collectives
    from boost_jax.parallel import make_plan
    from boost_jax.training.step import setup

    cfg = tiny("model.arch=cola", "log.health=false", "train.batch_size=4", "train.seq_len=32", "parallel.dp=1",
               *overrides)
    run, state = setup(cfg, make_plan(cfg, jax.devices()[:2]))
    params = run.state_shardings.params
    update = jax.jit(run.tx.update, in_shardings=(params, run.state_shardings.opt_state, params))
    return cfg, collectives(update.lower(state.params, state.opt_state, state.params).compile().as_text())


def test_adamw_under_tp_adds_no_collective_but_the_clips_norm():
    """AdamW is elementwise: under tp=2 its update's only collective is the global-norm clip's scalar
    (muon's and spectron's ways are pinned in tests/test_muon_layout.py)."""
    _, adamw = optimizer_collectives("parallel.tp=2")
    assert [(c.kind, c.shape) for c in adamw] == [("all-reduce", ())]


def test_a_latent_heads_b_is_orthogonalised_per_block_as_the_dense_block_diagonal_matrix():
    """Latent heads' stacked B [L, r, n] holds the blocks of a block-diagonal [r, g n]: its update is
    that matrix's polar factor, its blocks' own (Newton-Schulz per block), not the stacked matrix's;
    Spectron's sigma(B) is its largest block's."""
    from boost_jax.model.latent_heads import dense_b
    from boost_jax.training.optimizers import _top_singular_of_b, latent_head_blocks, newton_schulz

    # Cubic Newton-Schulz, iterated to convergence: the polar factor itself, so the claim is exact.
    cfg = tiny("model.arch=cola", "model.attn_latent_heads=2", "train.optimizer=muon", "train.muon.ns_steps=60",
               "train.muon.ns_coeffs=[1.5,-0.5,0.0]")
    blocks = latent_head_blocks(cfg.model)
    assert blocks == {("layers", "attn", "k", "b"): 8, ("layers", "attn", "v", "b"): 8}  # r = 16, g = 2
    x = jax.random.normal(jax.random.key(0), (2, 16, 32))  # [L, r, n]: two blocks of [8, 32] per layer
    update = lambda blocks: np.asarray(newton_schulz(cfg.train.muon, {}, blocks).update(
        {"layers": {"attn": {"k": {"b": x}}}}, optax.EmptyState())[0]["layers"]["attn"]["k"]["b"])

    def polar(m):
        u, _, vt = np.linalg.svd(m, full_matrices=False)
        return u @ vt

    dense = dense_b(np.asarray(x, np.float64), 2)  # [L, r, g n]
    want = np.stack([polar(d) for d in dense])
    np.testing.assert_allclose(dense_b(update(blocks), 2), want, atol=1e-4)
    assert np.abs(dense_b(update({}), 2) - want).max() > 0.1  # the stacked matrix's polar factor mixes the blocks

    b = x[:, :, :8]  # [L, 16, 8]: blocks [8, 8]
    sigma, _ = _top_singular_of_b(b, jnp.full((2, 16), 0.25), 200, False, rows=8)
    block_max = [max(np.linalg.norm(np.asarray(b[i, j * 8:(j + 1) * 8]), 2) for j in range(2)) for i in range(2)]
    np.testing.assert_allclose(sigma, block_max, rtol=1e-4)
    assert np.all(np.asarray(_top_singular_of_b(b, jnp.full((2, 16), 0.25), 200, False, rows=None)[0]) > sigma)
