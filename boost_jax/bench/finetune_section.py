"""The results page's section 12 (`--finetune-json`, a saved `bench finetune --json`): each path's held-out
exact match and completion loss, the packed batches' fill and the fine-tune's step beside pre-training's."""

from __future__ import annotations

from boost_jax.bench import finetune
from boost_jax.bench.finetune_task import HELDOUT_SHARE
from boost_jax.bench.page import render

FILL_TARGET, SPEED_TARGET = 0.90, 0.90  # issue 72's: of each batch's positions; of pre-training's tokens/s


def finetune_section(r: dict) -> list[str]:
    user, answer = r["task"]["example"]
    fill = r["fill"]
    return render("finetune", command=r["command"], minutes=f"{r['minutes']:.0f}", device=r["device"],
                  corpus=r["corpus"], example_user=user["content"], example_answer=answer["content"],
                  lines=f"{r['task']['lines']:,}", heldout_share=f"{100 * HELDOUT_SHARE:.0f}%",
                  train_rows=f"{r['task']['train_rows']:,}", heldout_rows=r["task"]["heldout_rows"], model=r["model"],
                  d_model=r["d_model"], n_layers=r["n_layers"], pretrain_tokens=f"{r['pretrain_tokens']:,}",
                  pretrain_steps=r["pretrain_steps"], batch_size=r["batch_size"], seq_len=r["seq_len"],
                  finetune_steps=r["finetune_steps"], finetune_positions=f"{r['finetune_positions']:,}",
                  lr=f"{r['finetune_lr']:g}", seeds=" and ".join(map(str, r["seeds"])), table=finetune.table(r),
                  fill_min=f"{100 * fill['min']:.1f}%", fill_mean=f"{100 * fill['mean']:.1f}%",
                  fill_batches=fill["batches"], throughput=finetune.throughput_table(r), verdict=verdict(r))


def verdict(r: dict) -> str:
    """The issue's two throughput targets, each met or missed, in words."""
    fill = r["fill"]["min"]
    parts = [f"Targets: every packed batch at least {100 * FILL_TARGET:.0f}% tokens: "
             + ("met" if fill >= FILL_TARGET else f"missed (the least full holds {100 * fill:.1f}%)")]
    for s in r["throughput"]:
        ratio = s["ratio_with_packing"]
        parts.append(f"{s['arch']}'s fine-tune at least {SPEED_TARGET:.1f}x pre-training's positions per second: "
                     + ("met" if ratio >= SPEED_TARGET else "missed") + f" ({ratio:.2f}x with packing; its tokens, "
                     f"padding left out, {ratio * r['fill']['mean']:.2f}x)")
    return "; ".join(parts) + "."
