"""JAX's persistent compilation cache (boost_jax/launch/compile_cache.py): small CPU programs are kept and
read back by a later compile, a damaged entry is a warning and a fresh compile, and a folder that
cannot hold the cache is one warning, the command running uncached."""

import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compilation_cache

from boost_jax.config import DataConfig, load_config
from boost_jax.launch import compile_cache

SETTINGS = ("jax_enable_compilation_cache", "jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
            "jax_persistent_cache_min_entry_size_bytes", "jax_compilation_cache_max_size")
HIT = "/jax/compilation_cache/cache_hits"  # jax.monitoring's event of a program read back from the folder


@pytest.fixture(autouse=True)
def jax_settings_restored():
    """Each test leaves JAX's cache settings as it found them (the test run's own cache)."""
    saved = {name: getattr(jax.config, name) for name in SETTINGS}
    yield
    for name, value in saved.items():
        jax.config.update(name, value)
    compilation_cache.reset_cache()


def events_of(fn):
    """(the jax.monitoring events fired while `fn()` runs, its result)."""
    seen = []
    listen = lambda event, *_, **__: seen.append(event)
    jax.monitoring.register_event_listener(listen)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        out = fn()
    finally:
        jax.monitoring.unregister_event_listener(listen)
        jax.monitoring.unregister_event_duration_listener(listen)
    return seen, out


def test_the_setting_names_the_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "jax"))
    assert compile_cache.folder(DataConfig()) == tmp_path / "jax"
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    assert compile_cache.folder(DataConfig(cache_dir=str(tmp_path))) == tmp_path / "xla"
    assert compile_cache.folder(DataConfig(compile_cache_dir=str(tmp_path / "mine"))) == tmp_path / "mine"
    assert compile_cache.folder(load_config(None, ["data.compile_cache=false"]).data) is None


def test_a_small_program_is_kept_and_read_back_and_a_damaged_entry_recompiled(tmp_path):
    data = DataConfig(compile_cache_dir=str(tmp_path / "xla"))
    assert compile_cache.enable(data) == tmp_path / "xla"
    double = jax.jit(lambda x: x * 2 + 1)  # a program of its own: in no cache yet
    x = jnp.arange(5.0)
    compiled, _ = events_of(lambda: double(x))
    assert HIT not in compiled
    entries = sorted((tmp_path / "xla").glob("*-cache"))
    assert entries  # kept, though it compiled in milliseconds
    assert isinstance(compilation_cache._cache, compile_cache.AtomicFileCache)  # each entry renamed into place
    assert not [p for p in (tmp_path / "xla").iterdir() if p.suffix == ".tmp"]
    jax.clear_caches()  # as a new process would: only the folder remembers it
    read_back, out = events_of(lambda: double(x))
    assert HIT in read_back
    np.testing.assert_array_equal(out, x * 2 + 1)
    for entry in entries:
        entry.write_bytes(b"not an executable")
    jax.clear_caches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recompiled, out = events_of(lambda: double(x))
    assert HIT not in recompiled
    assert any("Error reading persistent compilation cache entry" in str(w.message) for w in caught)
    np.testing.assert_array_equal(out, x * 2 + 1)
    # The fresh program replaced its damaged entry: the next process reads it back.
    (entry,) = [e for e in entries if e.name.startswith("jit__lambda-")]
    assert entry.read_bytes() != b"not an executable"
    jax.clear_caches()
    assert HIT in events_of(lambda: double(x))[0]


def test_jaxs_warning_of_an_entry_it_cannot_read_is_one_line(tmp_path, capsys):
    compile_cache.enable(DataConfig(compile_cache_dir=str(tmp_path / "xla")))
    warnings.showwarning(UserWarning(f"{compile_cache.READ_ERROR}'jit_f': ZstdError: bad frame"), UserWarning,
                         "jax/_src/compiler.py", 782)
    assert capsys.readouterr().err == (f"warning: compilation cache {tmp_path / 'xla'}: the entry of 'jit_f' could not "
                                       "be read back (damaged, or from another build: ZstdError: bad frame); "
                                       "compiled afresh\n")


def test_a_folder_named_by_the_environment_is_warned_about_by_that_name(tmp_path, capsys, monkeypatch):
    """$JAX_COMPILATION_CACHE_DIR, not data.compile_cache_dir (a key the user never set), is named."""
    (tmp_path / "FILE").write_text("a file")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "FILE"))
    assert compile_cache.enable(DataConfig()) is None
    assert f"warning: $JAX_COMPILATION_CACHE_DIR: {tmp_path / 'FILE'} is a file" in capsys.readouterr().err


@pytest.mark.parametrize("where, why", [("FILE", "is a file, not a folder"), ("FILE/xla", "is under a file"),
                                        ("/proc/boost_jax_xla", "cannot be written")])
def test_a_folder_that_cannot_hold_the_cache_is_one_warning_and_no_cache(tmp_path, capsys, where, why):
    (tmp_path / "FILE").write_text("a file")
    path = where.replace("FILE", str(tmp_path / "FILE"))
    data = DataConfig(compile_cache_dir=path)
    assert compile_cache.enable(data) is None and compile_cache.enable(data) is None
    assert not jax.config.jax_enable_compilation_cache
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and f"data.compile_cache_dir: {path} {why}" in err, err
    assert float(jax.jit(lambda x: x + 1)(1.0)) == 2.0  # and the work runs, uncached
    on = compile_cache.enable(dataclasses.replace(data, compile_cache_dir=str(tmp_path / "ok")))
    assert on == tmp_path / "ok" and jax.config.jax_enable_compilation_cache
