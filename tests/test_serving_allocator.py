"""Scenario tests of the Jenga allocator: prefix hits for full + sliding-window groups, early freeing of
out-of-window blocks, eviction order and alignment, request-aware two-level allocation, full-pool and
too-large behaviour, budgeted snapshots, and waste accounting against uniform paging.

The hit-length scenarios follow those of vLLM's hybrid KV-cache manager tests (test_prefix_caching.py,
test_single_type_kv_cache_manager.py), rewritten for this API.
"""

import pytest

from kvjax.jenga import (
    AuxiliaryModelSpec,
    BudgetedSpec,
    FullAttentionSpec,
    JengaAllocator,
    QuestMetadataSpec,
    RequestTooLargeError,
    SlidingWindowSpec,
    StalePrefixHitError,
    UniformPagingSpec,
    chain_hashes,
)

TINY = dict(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32")  # 8 bytes per token


def full(name="full", tpp=16, **kw):
    return FullAttentionSpec(name=name, tokens_per_page=tpp, **{**TINY, **kw})


def sliding(name="sw", tpp=16, window=32, **kw):
    return SlidingWindowSpec(name=name, tokens_per_page=tpp, window=window, **{**TINY, **kw})


def run_step(alloc, request_id, tokens, hit=None):
    allocation = alloc.allocate(request_id, tokens, prefix_hit=hit)
    assert allocation is not None
    alloc.commit(request_id)
    return allocation


def snapshot_of_state(alloc):
    """Everything observable through the public API, to check that failed calls change nothing."""
    pages = {
        spec.name: tuple((alloc.page_state(spec.name, p), alloc.page_refcount(spec.name, p)) for p in range(alloc.layout.num_pages(spec.name)))
        for spec in alloc.specs
    }
    return (
        pages,
        {spec.name: tuple(alloc.evictable_pages(spec.name)) for spec in alloc.specs},
        tuple(alloc.large_page_group(l) for l in range(alloc.layout.num_large_pages)),
        {rid: alloc.block_tables(rid) for rid in alloc.request_ids},
        alloc.num_free_large_pages(),
    )


# ---------------------------------------------------------------------------------------------------
# Prefix hits
# ---------------------------------------------------------------------------------------------------
def test_full_attention_prefill_hit_and_eviction_order():
    alloc = JengaAllocator([full()], pool_bytes=full().page_bytes * 11)
    common = [i for i in range(3) for _ in range(16)]  # 3 full blocks

    prompt0 = common + [3] * 7
    hit = alloc.get_computed_prefix(prompt0)
    assert hit.num_tokens == 0
    run_step(alloc, "0", prompt0, hit)
    pages0 = alloc.block_tables("0")["full"]
    assert len(pages0) == 4

    prompt1 = common + [3] * 5
    hit = alloc.get_computed_prefix(prompt1)
    assert hit.num_tokens == 48 and hit.pages["full"] == pages0[:3]
    allocation = run_step(alloc, "1", prompt1[48:], hit)
    assert len(allocation.new_pages["full"]) == 1
    assert [alloc.page_refcount("full", p) for p in pages0[:3]] == [2, 2, 2]
    assert alloc.page_refcount("full", pages0[3]) == 1

    alloc.free("0")
    alloc.free("1")
    # Only the three full common blocks stay cached; the partial blocks were freed.
    assert alloc.evictable_pages("full") == [pages0[2], pages0[1], pages0[0]]  # deepest first
    assert alloc.num_free_large_pages() == 8

    # A hit after the owners finished reuses the cached pages.
    hit = alloc.get_computed_prefix(common + [3] * 6)
    assert hit.num_tokens == 48 and hit.pages["full"] == pages0[:3]
    run_step(alloc, "2", [3] * 6, hit)
    alloc.free("2")

    # A 10-block miss takes the 8 free pages, then evicts the cached ones deepest first.
    allocation = run_step(alloc, "3", [99] * 160)
    assert sorted(allocation.new_pages["full"][-2:]) == sorted(pages0[1:3])
    assert allocation.new_pages["full"][-2:] == (pages0[2], pages0[1])
    assert alloc.evictable_pages("full") == [pages0[0]]
    alloc.check_invariants()


def test_hit_limited_to_all_but_last_token():
    alloc = JengaAllocator([full()], pool_bytes=full().page_bytes * 8)
    prompt = list(range(32))
    run_step(alloc, "a", prompt)
    alloc.free("a")
    assert alloc.get_computed_prefix(prompt).num_tokens == 16  # 32 would leave nothing to compute
    assert alloc.get_computed_prefix(prompt + [7]).num_tokens == 32


HYBRID_COMMON = [i for i in range(3) for _ in range(16)]
HYBRID_PROMPT = HYBRID_COMMON + [3] * 5


def hybrid_allocator_after_two_requests():
    """Full + two sliding-window groups (window 2 blocks), after two requests sharing 3 blocks ran and
    finished (the shape of vLLM's test_prefill_hybrid_model)."""
    alloc = JengaAllocator([full(), sliding("sw1"), sliding("sw2")], pool_bytes=full().page_bytes * 21)
    run_step(alloc, "0", HYBRID_COMMON + [3] * 7)
    tables0 = alloc.block_tables("0")
    # 55 tokens computed: the next query reads tokens 24.., so sliding block 0 was released early.
    assert tables0["sw1"][0] == -1 and tables0["sw2"][0] == -1 and -1 not in tables0["full"]
    hit = alloc.get_computed_prefix(HYBRID_PROMPT)
    assert hit.num_tokens == 48
    assert hit.pages["full"] == tables0["full"][:3]
    assert hit.pages["sw1"] == (-1,) + tables0["sw1"][1:3]
    allocation = run_step(alloc, "1", HYBRID_PROMPT[48:], hit)
    assert all(len(pages) == 1 for pages in allocation.new_pages.values())
    alloc.free("0")
    alloc.free("1")
    alloc.check_invariants()
    return alloc


@pytest.mark.parametrize(
    "evicted, expected_blocks",
    [
        ([("sw1", 0), ("sw2", 0)], 3),  # outside the last window: no effect
        ([("full", 0)], 0),  # full attention needs every block
        ([("full", 2), ("sw1", 2), ("sw2", 2)], 2),
        ([("full", 2)], 2),
        ([("sw1", 2)], 2),
        ([("sw2", 2)], 2),
        # full reaches 2 blocks; at 2 blocks the window needs sliding block 0, which is gone: no
        # length is valid for every group.
        ([("full", 2), ("sw1", 0), ("sw2", 0)], 0),
    ],
)
def test_hybrid_hit_lengths(evicted, expected_blocks):
    alloc = hybrid_allocator_after_two_requests()
    hashes = chain_hashes(HYBRID_COMMON, 16)
    for group, block in evicted:
        assert alloc.uncache(group, hashes[block])
    hit = alloc.get_computed_prefix(HYBRID_PROMPT)
    assert hit.num_tokens == expected_blocks * 16
    assert all(len(pages) == expected_blocks for pages in hit.pages.values())
    alloc.check_invariants()


@pytest.mark.parametrize("aligned", [True, False])
def test_sliding_window_frees_out_of_window_blocks_early(aligned):
    """Window 4 (the query at p reads keys p-3..p, as Mistral and Gemma-2 mask), pages of 2 tokens: a
    block is released once all its tokens are before the next query's window."""
    alloc = JengaAllocator([sliding(tpp=2, window=4)], pool_bytes=sliding().page_bytes * 64, align_early_released=aligned)
    run_step(alloc, "finished", list(range(500, 503)))  # one full block, cached when it finishes
    alloc.free("finished")
    finished_pages = alloc.evictable_pages("sw")
    assert len(finished_pages) == 1
    tokens = list(range(100, 124))
    page_of_block = {}

    def step(new_tokens):
        run_step(alloc, "r", new_tokens)
        table = alloc.block_tables("r")["sw"]
        page_of_block.update({b: p for b, p in enumerate(table) if p >= 0})
        return table

    table = step(tokens[:4])  # next query 4 reads 1..4: token 0 is out, but block 0 holds token 1
    assert -1 not in table
    table = step(tokens[4:5])  # next query 5 reads 2..5: block 0 released
    assert table[0] == -1 and -1 not in table[1:]
    assert alloc.page_state("sw", page_of_block[0]) == "cached"
    table = step(tokens[5:6])  # query 6 reads 3..6: block 1 still holds token 3
    assert table[1] == page_of_block[1]
    table = step(tokens[6:7])  # query 7 reads 4..7: block 1 released
    assert table[:2] == (-1, -1)
    table = step(tokens[7:11])  # query 11 reads 8..11: blocks 2 and 3 released together
    assert table[:4] == (-1,) * 4 and -1 not in table[4:]
    # Among themselves the early-released blocks go in release order, the deeper of two released
    # together first.
    early = [page_of_block[b] for b in (0, 1, 3, 2)]
    if aligned:
        # Evictable now, but after every page of a finished request while their own request runs.
        assert alloc.evictable_pages("sw") == finished_pages + early
    else:
        assert alloc.evictable_pages("sw") == finished_pages + early  # "finished" was released first
        run_step(alloc, "late", list(range(600, 603)))
        alloc.free("late")  # released after them: with plain LRU it goes after them
        assert alloc.evictable_pages("sw")[: 1 + len(early)] == finished_pages + early
    alloc.free("r")
    order = alloc.evictable_pages("sw")
    if aligned:
        # Once r finishes, all its blocks share its release time: deepest first, as one prefix.
        assert order[1:] == [page_of_block[b] for b in (4, 3, 2, 1, 0)]
    else:
        assert order[1 : 1 + len(early)] == early
    alloc.check_invariants()


def test_aligned_early_release_keeps_shared_prefix_hits_under_pressure():
    """The Gemma-2 case: a shared document's sliding-window blocks leave the window while the request
    that computed them is still running. Aligned, pressure evicts a finished request's pages first and
    the document still hits; by release time, the document's window goes first and the hit is lost."""
    hits = {}
    for aligned in (True, False):
        specs = [full(tpp=4), sliding(tpp=4, window=8)]
        alloc = JengaAllocator(specs, pool_bytes=specs[0].page_bytes * 40, align_early_released=aligned)
        document = list(range(1, 33))
        run_step(alloc, "a", document + [50] * 4)  # 36 tokens: sliding blocks 0..6 released early
        run_step(alloc, "other", [7] * 40)
        alloc.free("other")  # an unrelated request finishes later: 10 + 10 cached pages
        assert alloc.num_free_large_pages() == 2
        run_step(alloc, "filler", [9] * 44)  # 11 + 11 pages: 20 evictions
        # A hit at 32 needs sliding blocks 6 and 7 (tokens 25..31); block 6 was released early.
        hits[aligned] = alloc.get_computed_prefix(document + [60]).num_tokens
        alloc.check_invariants()
    assert hits == {True: 32, False: 0}


def test_eviction_is_lru_across_requests_and_aligned_across_groups():
    # Quest metadata pages are 16x smaller than the KV pages, so many share one large page: evicting a
    # KV page makes room without touching them, which is where alignment shows.
    kv = full()  # 128-byte pages
    meta = QuestMetadataSpec(name="quest", tokens_per_page=16, **TINY)  # 8-byte pages, 16 per large page
    assert meta.page_bytes * 16 == kv.page_bytes
    alloc = JengaAllocator([kv, meta], pool_bytes=kv.page_bytes * 9)
    old = [1] * 64
    new = [2] * 64
    run_step(alloc, "old", old)
    run_step(alloc, "new", new)
    alloc.free("old")
    alloc.free("new")  # 8 KV pages cached (4 + 4), 1 large page for all quest pages
    assert alloc.num_free_large_pages() == 0
    old_hashes, new_hashes = chain_hashes(old, 16), chain_hashes(new, 16)

    run_step(alloc, "x", [5] * 17)  # needs 2 KV pages (and 2 quest slots, which are free)
    # LRU: "old" was released first; within it the deepest blocks go first; the Quest entries of the
    # evicted prefixes go with them although their slots were not needed.
    for block in (2, 3):
        assert alloc.cached_pages("full", old_hashes[block]) is None
        assert alloc.cached_pages("quest", old_hashes[block]) is None
    for block in (0, 1):
        assert alloc.cached_pages("full", old_hashes[block]) is not None
        assert alloc.cached_pages("quest", old_hashes[block]) is not None
    assert all(alloc.cached_pages("full", h) is not None for h in new_hashes)
    assert alloc.get_computed_prefix(old + [0]).num_tokens == 32
    assert alloc.get_computed_prefix(new + [0]).num_tokens == 64
    alloc.check_invariants()


def test_sliding_eviction_does_not_cascade_to_full_attention():
    alloc = JengaAllocator([full(), sliding(window=200)], pool_bytes=full().page_bytes * 16)
    prompt = [4] * 64 + [1]
    run_step(alloc, "a", prompt)
    alloc.free("a")
    hashes = chain_hashes(prompt, 16)
    sliding_page = alloc.cached_pages("sw", hashes[0])[0]
    alloc._cache.evict(1, sliding_page)  # noqa: SLF001 - what allocation pressure would do
    assert alloc.cached_pages("full", hashes[0]) is not None  # the full page is still useful
    full_page = alloc.cached_pages("full", hashes[3])[0]
    alloc._cache.evict(0, full_page)  # noqa: SLF001
    assert alloc.cached_pages("sw", hashes[3]) is None  # went with the full page
    alloc.check_invariants()


def test_requests_sharing_a_prefix_keep_its_last_window_for_reuse():
    """A request whose prompt starts with a cached prefix keeps the sliding blocks of that prefix's last
    window (the ones a hit at the prefix end needs) until it finishes; so the shared prefix still hits
    after pressure has evicted every evictable page."""
    hits, tables = {}, {}
    for keep in (True, False):
        specs = [full(tpp=4), sliding(tpp=4, window=8)]
        alloc = JengaAllocator(specs, pool_bytes=specs[0].page_bytes * 48, keep_shared_prefix_window=keep)
        document = list(range(1, 33))
        run_step(alloc, "a", document + [50] * 4)
        hit = alloc.get_computed_prefix(document + [51] * 12)
        assert hit.num_tokens == hit.shared_prefix_tokens == 32
        run_step(alloc, "b", [51] * 12, hit)  # 44 tokens: its window is tokens 37..43
        tables[keep] = alloc.block_tables("b")["sw"]
        alloc.free("a")
        filler = 0
        while alloc.can_allocate(f"filler{filler}", 4):  # one page in each group
            run_step(alloc, f"filler{filler}", [100 + filler] * 4)
            filler += 1
        # Everything evictable went (one odd page may be left: a request needs a page in each group).
        assert alloc.num_free_large_pages() == 0 and sum(len(alloc.evictable_pages(s.name)) for s in specs) <= 1
        hits[keep] = alloc.get_computed_prefix(document + [60]).num_tokens
        alloc.check_invariants()
        stats = alloc.stats()
        assert stats.kept_bytes == (2 * specs[1].page_bytes if keep else 0)
    # Kept: blocks 6 and 7 (tokens 24..31, the window before 32) stay with b; the rest was released.
    assert tables[True][:9] == (-1,) * 6 + tables[True][6:8] + (-1,) and -1 not in tables[True][6:8]
    assert tables[False][:9] == (-1,) * 9
    assert hits == {True: 32, False: 0}


# ---------------------------------------------------------------------------------------------------
# Two-level allocation
# ---------------------------------------------------------------------------------------------------
def test_request_aware_allocation_and_large_page_freed_with_last_small_page():
    kv = full()
    meta = QuestMetadataSpec(name="quest", tokens_per_page=16, **TINY)
    alloc = JengaAllocator([kv, meta], pool_bytes=kv.page_bytes * 10, enable_prefix_caching=False, fresh_large_page_first=True)
    run_step(alloc, "a", [1] * 16)
    run_step(alloc, "b", [2] * 16)
    run_step(alloc, "a", [1] * 16)
    quest_a = alloc.block_tables("a")["quest"]
    quest_b = alloc.block_tables("b")["quest"]
    per_large = alloc.layout.pages_per_large("quest")
    # a's second quest page goes into the large page a already uses; b got a fresh one.
    assert quest_a[0] // per_large == quest_a[1] // per_large != quest_b[0] // per_large
    large_a = quest_a[0] // per_large
    free_before = alloc.num_free_large_pages()
    alloc.free("a")
    assert alloc.large_page_group(large_a) is None
    assert alloc.num_free_large_pages() == free_before + 1 + 2  # a's quest large page + 2 KV pages
    alloc.check_invariants()


def test_default_placement_fills_partly_used_large_pages_before_fresh_ones():
    kv = full()
    meta = QuestMetadataSpec(name="quest", tokens_per_page=16, **TINY)
    alloc = JengaAllocator([kv, meta], pool_bytes=kv.page_bytes * 10, enable_prefix_caching=False)
    run_step(alloc, "a", [1] * 16)
    run_step(alloc, "b", [2] * 16)
    run_step(alloc, "a", [1] * 16)
    per_large = alloc.layout.pages_per_large("quest")
    larges = {p // per_large for rid in ("a", "b") for p in alloc.block_tables(rid)["quest"]}
    assert len(larges) == 1  # all three quest pages share one large page
    alloc.free("a")
    assert alloc.large_page_group(larges.pop()) == "quest"  # b's page keeps it
    alloc.check_invariants()


def test_full_pool_returns_none_and_changes_nothing():
    alloc = JengaAllocator([full(), sliding()], pool_bytes=full().page_bytes * 6)
    run_step(alloc, "a", [1] * 40)  # 3 blocks per group
    before = snapshot_of_state(alloc)
    assert not alloc.can_allocate("b", 40)
    assert alloc.allocate("b", [2] * 40) is None
    assert snapshot_of_state(alloc) == before
    assert "b" not in alloc.request_ids
    alloc.free("a")
    assert alloc.can_allocate("b", 40)
    assert alloc.allocate("b", [2] * 40) is not None
    alloc.check_invariants()


def test_can_allocate_counts_evictable_pages_and_cross_group_reclaim():
    # Only cached pages of group "full" are left; group "sw" can still get a page by reclaiming them.
    alloc = JengaAllocator([full(), sliding(window=1000)], pool_bytes=full().page_bytes * 4)
    run_step(alloc, "a", [1] * 32)
    alloc.free("a")
    assert alloc.num_free_large_pages() == 0
    assert alloc.can_allocate("b", 17)
    before = snapshot_of_state(alloc)
    assert alloc.can_allocate("b", 17)  # a dry run changes nothing
    assert snapshot_of_state(alloc) == before
    run_step(alloc, "b", [9] * 17)
    alloc.check_invariants()


def test_request_too_large_raises_with_sizes():
    alloc = JengaAllocator([full(), sliding()], pool_bytes=full().page_bytes * 6)
    with pytest.raises(RequestTooLargeError, match=r"'big'.*100 tokens.*large pages.*but the pool has 6 \(768 bytes\)"):
        alloc.can_allocate("big", 100)
    with pytest.raises(RequestTooLargeError):
        alloc.allocate("big", [0] * 100)
    assert alloc.request_ids == ()
    # A sliding window bounds its group's pages, so a long request fits when fed in small steps until
    # full attention alone outgrows the pool.
    alloc = JengaAllocator([full(), sliding(window=16)], pool_bytes=full().page_bytes * 6)
    for step in range(4):
        run_step(alloc, "long", [step] * 16)
    with pytest.raises(RequestTooLargeError, match="'long'"):
        alloc.allocate("long", [0] * 16)


def test_allocate_validates_its_arguments():
    alloc = JengaAllocator([full()], pool_bytes=full().page_bytes * 4)
    with pytest.raises(ValueError, match="at least one new token"):
        alloc.allocate("a", [])
    alloc.allocate("a", [1, 2])
    with pytest.raises(ValueError, match="not committed"):
        alloc.allocate("a", [3])
    alloc.commit("a")
    with pytest.raises(ValueError, match="nothing was allocated"):
        alloc.commit("a")
    with pytest.raises(ValueError, match="first allocate"):
        alloc.allocate("a", [3], prefix_hit=alloc.get_computed_prefix([1, 2, 3]))
    with pytest.raises(KeyError, match="unknown request 'zz'"):
        alloc.commit("zz")


def test_stale_prefix_hit_is_rejected():
    alloc = JengaAllocator([full()], pool_bytes=full().page_bytes * 4)
    prompt = [1] * 32 + [2]
    run_step(alloc, "a", prompt)
    alloc.free("a")
    hit = alloc.get_computed_prefix(prompt)
    assert hit.num_tokens == 32
    alloc.reset_prefix_cache()
    with pytest.raises(StalePrefixHitError, match="evicted since get_computed_prefix"):
        alloc.allocate("b", [2], prefix_hit=hit)


# ---------------------------------------------------------------------------------------------------
# Budgeted groups
# ---------------------------------------------------------------------------------------------------
def budgeted_allocator(snapshot_every=8):
    specs = [
        full(tpp=4),
        BudgetedSpec(name="budget", tokens_per_page=4, budget=6, policy="h2o(6)", snapshot_every=snapshot_every, **TINY),
    ]
    return JengaAllocator(specs, pool_bytes=specs[0].page_bytes * 40)


def test_budgeted_group_holds_at_most_budget_and_snapshots_at_boundaries():
    alloc = budgeted_allocator()
    prompt = list(range(1, 21))
    allocation = alloc.allocate("a", prompt[:8])
    assert len(allocation.new_pages["budget"]) == 2 and len(allocation.new_pages["full"]) == 2
    result = alloc.commit("a")
    assert len(alloc.block_tables("a")["budget"]) == 2  # 6 kept slots -> 2 pages
    assert [c.src for c in result.copies] == list(alloc.block_tables("a")["budget"])
    snapshot_8 = [c.dst for c in result.copies]
    assert all(alloc.page_state("budget", p) == "cached" for p in snapshot_8)

    allocation = alloc.allocate("a", prompt[8:16])  # 6 kept + 8 new = 14 slots = 4 pages
    assert len(alloc.block_tables("a")["budget"]) == 4
    result = alloc.commit("a")
    assert len(result.copies) == 2
    run_step(alloc, "a", prompt[16:20])  # 20 is not a multiple of 8: no snapshot
    alloc.free("a")

    hit = alloc.get_computed_prefix(prompt + [99])
    assert hit.num_tokens == 16  # the last snapshot; full attention alone could reuse 20
    allocation = alloc.allocate("b", (prompt + [99])[16:], prefix_hit=hit)
    assert [c.src for c in allocation.copies] == list(hit.pages["budget"])
    assert [c.dst for c in allocation.copies] == list(allocation.new_pages["budget"][:2])
    alloc.commit("b")

    diverging = prompt[:10] + [77] * 10
    assert alloc.get_computed_prefix(diverging).num_tokens == 8
    hit = alloc.get_computed_prefix(diverging)
    assert hit.pages["budget"] == tuple(snapshot_8)
    alloc.check_invariants()


def test_budgeted_group_without_snapshots_never_hits():
    alloc = budgeted_allocator(snapshot_every=None)
    prompt = list(range(1, 21))
    run_step(alloc, "a", prompt)
    alloc.free("a")
    assert alloc.get_computed_prefix(prompt).num_tokens == 0


def test_budgeted_kept_slots_override_is_checked():
    alloc = budgeted_allocator()
    alloc.allocate("a", [1, 2, 3])
    with pytest.raises(ValueError, match=r"kept_slots\['budget'\] must be an int in 0..3, got 4"):
        alloc.commit("a", kept_slots={"budget": 4})
    assert alloc.num_computed_tokens("a") == 0  # a rejected commit changes nothing
    with pytest.raises(ValueError, match="not budgeted"):
        alloc.commit("a", kept_slots={"full": 1})
    alloc.commit("a", kept_slots={"budget": 2})  # an engine's policy may keep fewer than the budget
    assert len(alloc.block_tables("a")["budget"]) == 1


# ---------------------------------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------------------------------
def test_stats_against_uniform_paging():
    specs = [full(), sliding(window=32)]
    jenga = JengaAllocator(specs, pool_bytes=4096, enable_prefix_caching=False)
    uniform = JengaAllocator([UniformPagingSpec(members=tuple(specs))], pool_bytes=4096, enable_prefix_caching=False)
    for alloc in (jenga, uniform):
        run_step(alloc, "r", list(range(100)))
    # Jenga: full holds 7 pages (112 slots) for 100 tokens; the window keeps blocks 4..6 for the
    # 31 tokens 69..99 the next query reads.
    stats = jenga.stats()
    assert stats.held_bytes == 10 * 128
    assert stats.needed_bytes == (100 + 31) * 8
    assert stats.waste_bytes == 10 * 128 - 131 * 8
    # Uniform: 7 pages of 2 layers x 16 tokens x 8 bytes; the sliding layer's tokens 0..68 are held
    # for nothing.
    stats = uniform.stats()
    assert stats.held_bytes == 7 * 256
    assert stats.needed_bytes == (100 + 31) * 8
    assert stats.waste_fraction == pytest.approx(1 - 131 * 8 / (7 * 256))


def test_stats_count_shared_pages_once_and_cached_pages_apart():
    alloc = JengaAllocator([full()], pool_bytes=full().page_bytes * 8)
    prompt = [1] * 32 + [5]
    run_step(alloc, "a", prompt)
    hit = alloc.get_computed_prefix(prompt)
    run_step(alloc, "b", prompt[hit.num_tokens :], hit)
    stats = alloc.stats()
    assert stats.needed_bytes == (32 + 1 + 1) * 8  # the two shared blocks once, two 1-token tails
    alloc.free("a")
    alloc.free("b")
    stats = alloc.stats()
    assert stats.cached_bytes == 2 * 128 and stats.needed_bytes == 0 and stats.waste_bytes == 0


def test_mixed_groups_share_one_pool():
    kv = FullAttentionSpec(name="kv", num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", tokens_per_page=16)
    meta = QuestMetadataSpec(name="quest", num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", tokens_per_page=16)
    aux = AuxiliaryModelSpec(name="aux", model="tiny", num_layers=3, num_kv_heads=1, head_dim=4, dtype="bfloat16", tokens_per_page=16)
    alloc = JengaAllocator([kv, meta, aux], pool_bytes=64 * 1024)
    assert alloc.layout.large_page_bytes == 3 * kv.page_bytes  # lcm(1024, 64, 768)
    run_step(alloc, "r", list(range(50)))
    tables = alloc.block_tables("r")
    assert {name: len(t) for name, t in tables.items()} == {"kv": 4, "quest": 4, "aux": 4}
    groups_in_use = {alloc.large_page_group(l) for l in range(alloc.layout.num_large_pages)} - {None}
    assert groups_in_use == {"kv", "quest", "aux"}
    alloc.check_invariants()


def test_regression_stale_hint_pointing_at_a_reserved_large_page():
    """A budgeted group frees the large page its last page was in when it shrinks at commit; that page
    was still the request's placement hint when the next allocate reserved it again (benchmark crash)."""
    budget = BudgetedSpec(name="budget", tokens_per_page=4, budget=4, **TINY)  # 32-byte pages,
    kv = full(tpp=4)  # one per 32-byte large page
    alloc = JengaAllocator([budget, kv], pool_bytes=32 * 12, enable_prefix_caching=False)
    run_step(alloc, "r", [1] * 4)
    run_step(alloc, "r", [2] * 4)  # 8 slots held during the step, shrunk back to 4 at commit
    assert len(alloc.block_tables("r")["budget"]) == 1
    run_step(alloc, "r", [3] * 8)  # needs 2 new budget pages; the stale hint is the lowest free page
    assert len(alloc.block_tables("r")["budget"]) == 1 and len(alloc.block_tables("r")["full"]) == 4
    alloc.check_invariants()
