"""The paged cache's allocator and data path (serving/pages.py, layers/paged_cache.py): thousands of random
admit / grow / finish / cancel events leak no page and give none to two sequences, and a sequence reads
back only what it wrote itself, whatever its pages held before (freed pages are masked, not zeroed)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from boost_jax.layers import paged_cache
from boost_jax.layers.kv_cache import KVCache, LatentCache
from boost_jax.serving.pages import NULL_PAGE, Pages


def check_invariants(pages: Pages, lengths: dict) -> None:
    owned = {s: pages.owned(s) for s in pages.sequences()}
    flat = [p for ps in owned.values() for p in ps]
    assert len(flat) == len(set(flat)), "a page owned twice"
    assert NULL_PAGE not in flat, "the null page owned"
    assert sorted(flat + pages._free) == list(range(1, pages.n_pages)), "a page leaked (neither owned nor free)"
    assert pages.unpromised >= 0
    for s, ps in owned.items():
        assert len(ps) == pages.pages_for(lengths[s]), "pages beyond (or short of) what the sequence wrote"
        table = pages.table(s)
        assert table[:len(ps)].tolist() == ps and (table[len(ps):] == NULL_PAGE).all()


def random_events(seed: int, n_events: int, pages: Pages):
    """Yield (event, seq, arg) at random, keeping `pages`'s promises; the caller applies them."""
    rng = np.random.default_rng(seed)
    reserved, lengths, next_id = {}, {}, 0
    for _ in range(n_events):
        kind = rng.choice(["admit", "admit", "admit", "grow", "grow", "finish", "cancel"])
        live = list(lengths)
        if kind == "admit" or not live:
            reserve = int(rng.integers(1, pages.max_pages * pages.page_tokens + 1))
            yield "admit", next_id, reserve
            if next_id in pages.sequences():
                reserved[next_id], lengths[next_id] = reserve, 0
            next_id += 1
        elif kind == "grow":
            s = live[rng.integers(len(live))]
            if lengths[s] < reserved[s]:
                n = int(rng.integers(lengths[s] + 1, reserved[s] + 1))
                yield "grow", s, n
                lengths[s] = n
        else:
            s = live[rng.integers(len(live))]
            yield kind, s, None
            del lengths[s], reserved[s]


@pytest.mark.parametrize("seed", range(3))
def test_random_events_leak_no_page_and_never_share_one(seed):
    pages = Pages(n_pages=33, page_tokens=4, max_pages=6)
    lengths, admitted, refused = {}, 0, 0
    for kind, s, arg in random_events(seed, 3000, pages):
        if kind == "admit":
            could = pages.can_admit(arg)
            assert pages.admit(s, arg) == could
            admitted, refused = admitted + could, refused + (not could)
            if could:
                lengths[s] = 0
        elif kind == "grow":
            pages.grow(s, arg)
            lengths[s] = arg
        else:
            getattr(pages, kind)(s)
            del lengths[s]
        check_invariants(pages, lengths)
    assert admitted > 100 and refused > 10  # the pool filled up and emptied, many times
    for s in pages.sequences():
        pages.cancel(s)
    assert pages.used == 0 and pages.free == pages.n_pages - 1


def test_a_sequence_never_grows_past_its_promise_nor_is_admitted_twice():
    pages = Pages(n_pages=5, page_tokens=4, max_pages=4)
    assert pages.admit("a", 8) and not pages.admit("b", 12)  # 2 promised of 4: 3 more are not free
    with pytest.raises(ValueError, match="past the pages it was promised"):
        pages.grow("a", 9)
    with pytest.raises(ValueError, match="already admitted"):
        pages.admit("a", 1)


@pytest.mark.parametrize("kind", [KVCache, LatentCache])
def test_a_sequence_reads_only_what_it_wrote_through_reused_pages(kind):
    """Each write tags a position with (sequence, position); after hundreds of events through the
    real gather and scatter, a sequence's view at every position below its length holds its own tags,
    though the pages it holds were written by others before (masked, not zeroed)."""
    page_tokens, max_pages, n_pages = 4, 4, 9
    pages = Pages(n_pages, page_tokens, max_pages)
    shape = (n_pages, 2, page_tokens, 3) if kind is KVCache else (n_pages, page_tokens, 3)
    pool = (kind(jnp.zeros(shape), jnp.zeros(shape)),)
    chunk = 5

    @jax.jit
    def write(pool, tables, positions, valid, tags):
        rows = paged_cache.view(pool, tables)
        # What a layer does: its tokens written at their positions into the contiguous view.
        tagged = lambda a: a.at[(jnp.arange(1)[:, None], *[slice(None)] * (a.ndim - 3), positions)].set(
            jnp.broadcast_to(tags.reshape(1, chunk, *[1] * (a.ndim - 2)), (1, chunk, *a.shape[1:-2], a.shape[-1])),
            mode="drop")
        rows = tuple(type(c)(tagged(c.k), tagged(c.v)) for c in rows)
        return paged_cache.store(pool, rows, tables, positions, valid)

    read = jax.jit(lambda pool, tables: paged_cache.view(pool, tables)[0].k)
    lengths, reused, checked = {}, 0, 0
    for kind_, s, arg in random_events(7, 400, pages):
        if kind_ == "admit":
            if pages.admit(s, arg):
                lengths[s] = 0
            continue
        if kind_ in ("finish", "cancel"):
            getattr(pages, kind_)(s)
            del lengths[s]
            continue
        while lengths[s] < arg:  # grow: write the new positions, a chunk at a time
            start = lengths[s]
            n = min(chunk, arg - start)
            before = set(pages.owned(s))
            pages.grow(s, start + n)
            reused += len(set(pages.owned(s)) - before)
            positions = (start + np.arange(chunk))[None].astype(np.int32)
            tags = (1000 * (s + 1) + positions[0]).astype(np.float32)
            pool = write(pool, pages.table(s)[None], positions, (np.arange(chunk) < n)[None], tags)
            lengths[s] = start + n
        for t, length in lengths.items():
            if not length:
                continue
            seen = np.asarray(read(pool, pages.table(t)[None]))[0]
            seen = seen[:, :length] if kind is KVCache else seen[:length]  # positions on the second-last axis
            expected = 1000 * (t + 1) + np.arange(length)
            assert (np.moveaxis(seen, -2, 0).reshape(length, -1) == expected[:, None]).all(), f"sequence {t} reads another's"
            checked += length
    assert reused > 50 and checked > 500
