"""Group specs (sizes, lifetimes, per-type hit rules), their combination, chained hashes, the large-page
rule and the pool layout."""

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvjax.jenga import (
    AuxiliaryModelSpec,
    BudgetedSpec,
    FullAttentionSpec,
    PoolLayout,
    QuestMetadataSpec,
    SlidingWindowSpec,
    UniformPagingSpec,
    chain_hashes,
    choose_large_page_bytes,
    hash_block,
    longest_common_hit,
)
from kvjax.util.hashing import ROOT_HASH

LLAMA3_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def test_page_sizes_of_real_shapes():
    kv = FullAttentionSpec(name="kv", **LLAMA3_8B)
    assert kv.page_bytes == 32 * 2 * 16 * 8 * 128 * 2 == 2 * 2**20
    assert kv.bytes_per_token == 128 * 1024
    quest = QuestMetadataSpec(name="quest", **LLAMA3_8B)
    assert quest.page_shape == (32, 2, 1, 8, 128)
    assert quest.page_bytes == kv.page_bytes // 16
    aux = AuxiliaryModelSpec(name="aux", model="tinyllama", num_layers=22, num_kv_heads=4, head_dim=64)
    assert aux.page_bytes == 22 * 2 * 16 * 4 * 64 * 2 == 360448
    gemma_local = SlidingWindowSpec(name="local", num_layers=21, num_kv_heads=8, head_dim=256, window=4096)
    assert gemma_local.bytes_per_token == 21 * 2 * 8 * 256 * 2
    uniform = UniformPagingSpec(members=(kv, quest, aux))
    # every one of the 86 layers at the widest per-layer size (Llama's 4096 bytes per token)
    assert uniform.page_bytes == 16 * (32 + 32 + 22) * 4096


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: FullAttentionSpec(name="", **LLAMA3_8B), "name must be a non-empty string"),
        (lambda: FullAttentionSpec(name="x", num_layers=0, num_kv_heads=8, head_dim=128), "num_layers must be a positive int, got 0"),
        (lambda: FullAttentionSpec(name="x", dtype="float64", num_layers=1, num_kv_heads=1, head_dim=1), "dtype must be one of"),
        (lambda: SlidingWindowSpec(name="x", window=0, **LLAMA3_8B), "window must be a positive int"),
        (lambda: QuestMetadataSpec(name="q", tokens_per_page=24, **LLAMA3_8B), r"tokens_per_page \(24\) must be a multiple of quest_page_size \(16\)"),
        (lambda: BudgetedSpec(name="b", budget=64, snapshot_every=40, **LLAMA3_8B), r"snapshot_every \(40\) must be a multiple"),
        (lambda: UniformPagingSpec(members=()), "members must be a non-empty tuple"),
    ],
)
def test_spec_validation_names_the_bad_field(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_needed_bytes_per_block():
    sw = SlidingWindowSpec(name="sw", num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32", tokens_per_page=4, window=6)
    # 10 tokens: the next query reads 5..9 -> block 1 keeps 3 of 4 tokens, block 2 keeps 2.
    assert [sw.needed_bytes_in_block(b, 10) for b in range(3)] == [0, 3 * 8, 2 * 8]
    quest = QuestMetadataSpec(name="q", num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32", tokens_per_page=32)
    entry = 2 * 4  # min and max of one head of one layer
    assert quest.needed_bytes_in_block(0, 17) == 2 * entry  # a partial Quest page needs its whole entry
    budget = BudgetedSpec(name="b", num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32", tokens_per_page=4, budget=6)
    uniform = UniformPagingSpec(members=(budget,), tokens_per_page=4)
    # 12 tokens kept down to 6: each block is charged half its bytes.
    assert sum(uniform.needed_bytes_in_block(b, 12) for b in range(3)) == pytest.approx(6 * 8)


# --- hit rules --------------------------------------------------------------------------------------
def cached_from_blocks(flags, tpp):
    """is_cached(end) for a positional group whose block b is cached iff flags[b]."""
    return lambda end: flags[end // tpp - 1]


def test_sliding_window_hit_rule():
    # The case of vLLM's sliding-window manager test: window 4, pages of 2 tokens. The next query at
    # L reads L-3..L, so a hit at L needs the 2 blocks holding tokens L-3..L-1 (all blocks when L < 3).
    sw = SlidingWindowSpec(name="sw", num_layers=1, num_kv_heads=1, head_dim=1, tokens_per_page=2, window=4)
    flags = [True, True, False, True, False, False, True, True, False, True, True, True]
    valid = [L for L in range(0, 25, 2) if sw.largest_hit(L, cached_from_blocks(flags, 2)) == L]
    assert valid == [0, 2, 4, 16, 22, 24]
    assert sw.largest_hit(24, cached_from_blocks(flags, 2)) == 24
    assert sw.largest_hit(21, cached_from_blocks(flags, 2)) == 16
    assert sw.largest_hit(15, cached_from_blocks(flags, 2)) == 4


def test_full_and_budgeted_hit_rules():
    full = FullAttentionSpec(name="f", num_layers=1, num_kv_heads=1, head_dim=1, tokens_per_page=2)
    flags = [True, True, False, True]
    assert full.largest_hit(8, cached_from_blocks(flags, 2)) == 4
    budget = BudgetedSpec(name="b", num_layers=1, num_kv_heads=1, head_dim=1, tokens_per_page=2, budget=4, snapshot_every=4)
    snapshots = {4, 12}
    assert budget.largest_hit(15, lambda end: end in snapshots) == 12
    assert budget.largest_hit(11, lambda end: end in snapshots) == 4
    no_snapshots = BudgetedSpec(name="b", num_layers=1, num_kv_heads=1, head_dim=1, tokens_per_page=2, budget=4)
    assert no_snapshots.largest_hit(15, lambda end: True) == 0


@settings(max_examples=200, deadline=None)
@given(
    full_flags=st.lists(st.booleans(), min_size=0, max_size=20),
    sliding_flags=st.lists(st.booleans(), min_size=20, max_size=20),
    snapshots=st.sets(st.integers(1, 10).map(lambda k: 4 * k)),
    window=st.integers(1, 12),
    limit=st.integers(0, 44),
)
# The budgeted group pulls L down to a snapshot (4) where the window's block is missing: one pass over
# the groups would return 4; the common answer is 0.
@example(full_flags=[True] * 10, sliding_flags=[True, False, True, True] + [False] * 16, snapshots={4}, window=3, limit=9)
def test_longest_common_hit_is_the_largest_length_every_group_accepts(full_flags, sliding_flags, snapshots, window, limit):
    full = FullAttentionSpec(name="f", num_layers=1, num_kv_heads=1, head_dim=1, tokens_per_page=2)
    sw = SlidingWindowSpec(name="s", num_layers=1, num_kv_heads=1, head_dim=1, tokens_per_page=2, window=window)
    budget = BudgetedSpec(name="b", num_layers=1, num_kv_heads=1, head_dim=1, tokens_per_page=2, budget=3, snapshot_every=4)
    full_flags = full_flags + [False] * (22 - len(full_flags))
    cached = [
        cached_from_blocks(full_flags, 2),
        cached_from_blocks(sliding_flags + [False] * 2, 2),
        lambda end: end in snapshots,
    ]
    specs = [full, sw, budget]

    def valid_for(spec_index, length):  # brute-force definitions, independent of largest_hit
        tpp = 2
        if length == 0:
            return True
        if spec_index == 0:
            return all(full_flags[:length // tpp])
        if spec_index == 1:
            first = max(0, length - (window - 1)) // tpp
            return all((sliding_flags + [False] * 2)[first : length // tpp])
        return length in snapshots

    expected = max(L for L in range(0, limit + 1, 4) if all(valid_for(g, L) for g in range(3)))
    assert longest_common_hit(specs, limit, cached) == expected


# --- hashes -----------------------------------------------------------------------------------------
def test_chained_hashes_name_whole_prefixes():
    tokens = list(range(40))
    hashes = chain_hashes(tokens, 16)
    assert len(hashes) == 2  # the 8-token tail has no hash
    assert hashes[0] == hash_block(ROOT_HASH, tokens[:16])
    assert hashes[1] == hash_block(hashes[0], tokens[16:32])
    # Same block tokens after a different prefix hash differently.
    other = chain_hashes([1] + tokens[1:], 16)
    assert other[0] != hashes[0] and other[1] != hashes[1]
    # Continuing a chain from the middle gives the same hashes.
    assert chain_hashes(tokens[16:32], 16, parent_hash=hashes[0]) == hashes[1:]
    assert hash_block(ROOT_HASH, tokens[:16], extra_key=b"lora-1") != hashes[0]
    with pytest.raises(ValueError, match="int64"):
        hash_block(ROOT_HASH, [2**70])


# --- large pages and layout -------------------------------------------------------------------------
def test_large_page_rule():
    assert choose_large_page_bytes([2048, 3072]) == 6144  # the LCM when it is small
    mib = 2**20
    kv, quest, aux = 2 * mib, 128 * 1024, 360448
    assert math.lcm(kv, quest, aux) == 11 * kv  # too large for max_ratio 8
    chosen = choose_large_page_bytes([kv, quest, aux])
    assert chosen == 5 * kv  # 29 aux pages leave 0.3% slack, the least among 1..8 x 2 MiB
    assert choose_large_page_bytes([kv, quest, aux], max_ratio=16) == 11 * kv
    with pytest.raises(ValueError, match="page_bytes must be positive"):
        choose_large_page_bytes([0, 4])


def test_layout_errors_name_sizes():
    spec = FullAttentionSpec(name="kv", **LLAMA3_8B)
    with pytest.raises(ValueError, match=r"pool of 1000 bytes holds no large page of 2097152 bytes"):
        PoolLayout.from_pool_bytes([spec], 1000)
    layout = PoolLayout.from_pool_bytes([spec], 10 * spec.page_bytes)
    with pytest.raises(IndexError, match=r"page id 10 out of range for group 'kv' \(0..9\)"):
        layout.locate("kv", 10)
    with pytest.raises(KeyError, match="unknown group 'nope'"):
        layout.spec("nope")


@settings(max_examples=100, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(st.integers(1, 3), st.integers(1, 3), st.sampled_from([1, 2, 3, 5, 8]), st.sampled_from(["float32", "bfloat16", "int8"])),
        min_size=1,
        max_size=4,
    ),
    num_large=st.integers(1, 5),
    max_ratio=st.integers(1, 4),
)
def test_layout_places_every_small_page_inside_its_large_page_without_overlap(shapes, num_large, max_ratio):
    specs = [
        FullAttentionSpec(name=f"g{i}", num_layers=l, num_kv_heads=h, head_dim=d, dtype=dt, tokens_per_page=4)
        for i, (l, h, d, dt) in enumerate(shapes)
    ]
    large = choose_large_page_bytes([s.page_bytes for s in specs], max_ratio)
    layout = PoolLayout(tuple(specs), large, num_large)
    for spec in specs:
        per_large = layout.pages_per_large(spec.name)
        assert per_large >= 1
        assert layout.tail_slack_bytes(spec.name) == large - per_large * spec.page_bytes >= 0
        ranges = []
        for page in range(layout.num_pages(spec.name)):
            big, offset = layout.locate(spec.name, page)
            assert layout.page_id(spec.name, big, offset // spec.page_bytes) == page
            start = layout.byte_offset(spec.name, page)
            assert big * large <= start and start + spec.page_bytes <= (big + 1) * large
            ranges.append((start, start + spec.page_bytes))
        ranges.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ranges, ranges[1:]))
    if math.lcm(*(s.page_bytes for s in specs)) <= max_ratio * max(s.page_bytes for s in specs):
        assert all(layout.tail_slack_bytes(s.name) == 0 for s in specs)


@settings(max_examples=100, deadline=None)
@given(first=st.integers(0, 12), width=st.integers(0, 12), num_tokens=st.integers(0, 120), window=st.integers(1, 40))
def test_needed_bytes_in_range_is_the_sum_over_its_blocks(first, width, num_tokens, window):
    tiny = dict(num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32", tokens_per_page=8)
    full = FullAttentionSpec(name="f", **tiny)
    sw = SlidingWindowSpec(name="s", window=window, **tiny)
    quest = QuestMetadataSpec(name="q", quest_page_size=4, **tiny)
    budget = BudgetedSpec(name="b", budget=10, **tiny)
    uniform = UniformPagingSpec(members=(full, sw, quest, budget), tokens_per_page=8)
    for spec in (full, sw, quest, uniform):
        per_block = sum(spec.needed_bytes_in_block(b, num_tokens) for b in range(first, first + width))
        assert spec.needed_bytes_in_range(first, first + width, num_tokens) == pytest.approx(per_block)
        # and never more than the blocks hold
        assert per_block <= width * spec.page_bytes + 1e-9
