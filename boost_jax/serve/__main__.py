"""python -m boost_jax.serve RUN_DIR [section.key=value ...] [--host 127.0.0.1] [--port 8000] [--step N]
[--cache auto|full|latent_v|latent] [--model-name NAME]

Serves a run's model (its newest checkpoint, or --step) over HTTP with OpenAI's API: /v1/models,
/v1/completions, /v1/chat/completions (the tokenizer's chat template), streamed by server-sent events
or whole; /health; /metrics (Prometheus). Requests are decoded together in `serve.slots` slots over a
paged KV cache (serve.page_tokens, serve.cache_gib); the overrides are the run's config keys, its
layout too (`parallel.tp=2 parallel.dp=1`). A bad config, a pool too small for one request at the
context, or a port in use is one message and exit 1, before the port is bound; SIGTERM (or Ctrl-C)
lets the running requests finish, refuses new ones and exits 0.
"""

from __future__ import annotations

import importlib.util
import signal
import sys
from pathlib import Path

from boost_jax.config.archs import AUTO_CACHE, CACHE_KINDS
from boost_jax.runtime.cli import run_dir_args, run_dir_parser, run_main
from boost_jax.runtime.errors import ConfigError, PackageError
from boost_jax.serving.listen import bind


def main(argv: list[str] | None = None) -> None:
    """The command line (one message and exit 1 on a user error)."""
    run_main(_main, argv)


def parse(argv: list[str]):
    p = run_dir_parser("python -m boost_jax.serve", __doc__)
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--cache", default=AUTO_CACHE, choices=[AUTO_CACHE, *CACHE_KINDS],
                   help="the KV cache kind paged (as generate's --cache; auto: the fewest bytes per device)")
    p.add_argument("--model-name", default="", help="the model's name in the API (default: the run dir's name)")
    a = run_dir_args(p, argv)
    if not 0 < a.port < 65536:
        raise ConfigError(f"--port must be in 1..65535, got {a.port}")
    return a


def _main(argv: list[str]) -> None:
    a = parse(argv)
    if missing := [p for p in ("fastapi", "uvicorn") if importlib.util.find_spec(p) is None]:
        raise PackageError(f"not installed: {', '.join(missing)}, for the server: pip install 'boost_jax[serve]'")
    import uvicorn  # optional: the serve extra

    from boost_jax.model.decode import choose_cache  # lazy: keeps --help free of JAX
    from boost_jax.model.run_dir import open_run  # lazy: keeps --help free of JAX
    from boost_jax.serving.api import Server, create_app  # lazy: keeps --help free of JAX
    from boost_jax.serving.engine import Engine  # lazy: keeps --help free of JAX
    from boost_jax.serving.programs import pool_size  # lazy: keeps --help free of JAX

    run = open_run(a.run_dir, a.config, decoding=True, prepare=True, reuse_memory=False)
    cfg, context = run.cfg, run.cfg.train.seq_len
    if not (a.run_dir / "tokenizer.json").is_file():
        raise ConfigError(f"{a.run_dir} has no tokenizer.json (a run writes it after its first step)")
    chat = chat_template(run)
    kind = choose_cache(cfg.model, run.plan).kind if a.cache == AUTO_CACHE else a.cache
    pool_size(cfg.serve, kind, cfg.model, run.plan, context)  # a pool too small is refused before the port
    sock = bind(a.host, a.port)  # before the slow restore: a port in use is said at once
    model, step = run.model(a.step)
    engine = Engine(model, run.plan, cfg.serve, cache=kind, eos_id=run.eos, context=context)
    del model
    engine.warm_up()
    server = Server(engine, run.tokenizer, model_name=a.model_name or Path(a.run_dir).resolve().name,
                    serve=cfg.serve, chat=chat)
    app = create_app(server)
    host, port = sock.getsockname()[:2]
    print(f"serving {server.model_name} (step {step}, cache {engine.kind}, {engine.pages.n_pages - 1} pages of "
          f"{cfg.serve.page_tokens} tokens, {cfg.serve.slots} slots) on http://{host}:{port}/v1", file=sys.stderr, flush=True)
    engine.start()
    uv = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=None))
    original = uv.handle_exit

    def handle_exit(sig, frame):  # SIGTERM / SIGINT: refuse new requests, let the running ones finish
        server.draining = True
        original(sig, frame)

    uv.handle_exit = handle_exit
    for sig in (signal.SIGTERM, signal.SIGINT):  # what uvicorn raises again after its shutdown: exit 0, not the signal
        signal.signal(sig, lambda *_: None)
    try:
        uv.run(sockets=[sock])
    finally:
        engine.stop()
    print(f"stopped: {engine.generated} tokens generated", file=sys.stderr)


def chat_template(run):
    """The run's chat template bound to its tokenizer (as `generate --chat` reads it), or None where
    it has none and data.chat_template names none (chat completions are then refused, one line says
    so); a template named but missing or broken stops the command."""
    try:
        return run.chat
    except ConfigError as e:
        if run.cfg.data.chat_template:
            raise
        print(f"no chat template, so /v1/chat/completions answers 400: {e}", file=sys.stderr)
        return None


if __name__ == "__main__":
    main()
