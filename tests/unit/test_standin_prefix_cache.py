"""The stand-in's radix cache as a client sees it: `meta_info.cached_tokens`, per server, as SGLang reports it."""

from __future__ import annotations

from datagen.standin.prefix_cache import PrefixCache


def test_a_prompt_that_extends_a_finished_request_finds_its_prompt_and_output_cached() -> None:
    cache = PrefixCache(1 << 20)
    assert cache.match([5, 6, 7, 8]) == 0  # nothing seen yet
    cache.insert([5, 6, 7, 8, 100, 101])  # a finished request: its input, then its output but the last token
    assert cache.match([5, 6, 7, 8, 100, 101, 102, 9, 9]) == 6
    assert cache.match([5, 6, 7, 1]) == 3  # a shared prefix only
    assert cache.match([5, 6, 7, 8]) == 3  # one token is always prefilled: at most all but the last
    assert cache.match([6, 5]) == 0


def test_without_the_radix_cache_nothing_is_cached() -> None:
    cache = PrefixCache(1 << 20, enabled=False)
    cache.insert([1, 2, 3, 4])
    assert cache.match([1, 2, 3, 4, 5]) == 0


def test_it_holds_about_its_kv_pool_the_oldest_going_first() -> None:
    cache = PrefixCache(20)  # two generations of about 10 tokens each
    cache.insert(list(range(100, 108)))
    cache.insert(list(range(200, 208)))  # the newer generation fills: it becomes the older one
    cache.insert(list(range(300, 304)))
    assert [cache.match([*range(b, b + 4), 1]) for b in (100, 200, 300)] == [4, 4, 4]
    cache.insert(list(range(400, 408)))  # full again: the oldest requests are gone, the recent ones kept
    assert [cache.match([*range(b, b + 4), 1]) for b in (100, 200, 300, 400)] == [0, 0, 4, 4]
