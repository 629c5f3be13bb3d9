"""Random traces against the allocator (hypothesis RuleBasedStateMachine).

A model device records what each small page holds (token per position for positional groups, the
prefix a budgeted state was computed from). Each step "writes" the tokens it computed into the pages
the allocator gave it, so a page handed to two owners, or a cached page reused while still cached,
shows up as wrong contents when a later request reuses the prefix. Invariants checked after every step
through the public API: refcount = number of tables holding the page, only cached positional pages are
shared, a large page is typed exactly while one of its small pages is not free, can_allocate agrees
with allocate, a failed allocate changes nothing, and nothing leaks once every request is freed.
"""

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import event as hypothesis_event
from hypothesis.control import currently_in_test_context
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvjax.jenga import (
    AuxiliaryModelSpec,
    BudgetedSpec,
    FullAttentionSpec,
    JengaAllocator,
    QuestMetadataSpec,
    RequestTooLargeError,
    SlidingWindowSpec,
)

SMALL = dict(num_layers=1, num_kv_heads=1, dtype="float32", tokens_per_page=4)
SPECS = (
    FullAttentionSpec(name="full", head_dim=2, **SMALL),  # 64 B
    SlidingWindowSpec(name="sliding", head_dim=2, window=6, **SMALL),  # 64 B
    QuestMetadataSpec(name="quest", head_dim=2, quest_page_size=4, **SMALL),  # 16 B
    AuxiliaryModelSpec(name="aux", head_dim=3, model="small", **SMALL),  # 96 B
    BudgetedSpec(name="budget", head_dim=2, budget=6, policy="test", snapshot_every=8, **SMALL),  # 64 B
)
# Large pages of lcm(64, 16, 96) = 192 bytes: 3 full, 3 sliding, 12 quest, 2 aux or 3 budget pages each.
PROMPT_STEMS = ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [20, 21, 22, 23, 24, 25, 26, 27, 28])
CHUNKS = st.one_of(st.sampled_from([4, 8]), st.integers(1, 9))  # aligned chunks make snapshots (and hits)


def event(label):
    """Coverage label for --hypothesis-show-statistics (a no-op when a test drives the machine directly)."""
    if currently_in_test_context():
        hypothesis_event(label)


def hit_skipped(request, window):
    """Sliding blocks a request never held: those before the window of its prefix hit."""
    return max(0, request["hit"] - (window - 1)) // 4


def fingerprint(alloc):
    pages = tuple(
        tuple((alloc.page_state(s.name, p), alloc.page_refcount(s.name, p)) for p in range(alloc.layout.num_pages(s.name)))
        for s in alloc.specs
    )
    return (
        pages,
        tuple(tuple(alloc.evictable_pages(s.name)) for s in alloc.specs),
        tuple(alloc.large_page_group(l) for l in range(alloc.layout.num_large_pages)),
        tuple((rid, tuple(alloc.block_tables(rid).items())) for rid in alloc.request_ids),
    )


class AllocatorMachine(RuleBasedStateMachine):
    specs = SPECS
    num_large_pages = 10
    enable_prefix_caching = True
    fresh_large_page_first = False

    def __init__(self):
        super().__init__()
        self.alloc = JengaAllocator(
            self.specs, pool_bytes=192 * self.num_large_pages, enable_prefix_caching=self.enable_prefix_caching,
            fresh_large_page_first=self.fresh_large_page_first,
        )
        assert self.alloc.layout.large_page_bytes == 192
        self.device = {}  # (group name, page) -> {position: token} or ("budget", prefix tokens, index)
        self.requests = {}  # id -> {"tokens": [...], "prompt_len": int, "computed": int}
        self.next_id = 0

    # --- model device -------------------------------------------------------------------------------
    def write_step(self, rid, new_positions):
        request = self.requests[rid]
        tables = self.alloc.block_tables(rid)
        for spec in self.specs:
            table = tables[spec.name]
            if spec.is_positional:
                for position in new_positions:
                    page = table[position // spec.tokens_per_page]
                    assert page >= 0, (spec.name, rid, position, table)
                    # Only the request itself may hold a page it writes, and it must not be cached yet.
                    assert self.alloc.page_refcount(spec.name, page) == 1, (spec.name, page)
                    self.device.setdefault((spec.name, page), {})[position] = request["tokens"][position]
            else:
                for page in table:
                    assert self.alloc.page_refcount(spec.name, page) == 1

    def stamp_budget_pages(self, rid):
        if "budget" not in self.alloc.layout.group_names:
            return
        request = self.requests[rid]
        prefix = tuple(request["tokens"][: request["computed"]])
        for index, page in enumerate(self.alloc.block_tables(rid)["budget"]):
            self.device[("budget", page)] = ("budget", prefix, index)

    def apply_copies(self, copies):
        for copy in copies:
            self.device[(copy.group, copy.dst)] = self.device.get((copy.group, copy.src))

    def check_contents(self, rid):
        """Pages the request still reads hold its tokens (positional) or its state (budgeted)."""
        request = self.requests[rid]
        tokens, computed = request["tokens"], request["computed"]
        for spec in self.specs:
            table = self.alloc.block_tables(rid)[spec.name]
            if spec.is_positional:
                for block, page in enumerate(table):
                    if page < 0:
                        continue
                    content = self.device.get((spec.name, page), {})
                    for position in range(block * spec.tokens_per_page, min(computed, (block + 1) * spec.tokens_per_page)):
                        assert content.get(position) == tokens[position], (spec.name, rid, block, page, position)
            else:
                for index, page in enumerate(table):
                    assert self.device.get(("budget", page)) == ("budget", tuple(tokens[:computed]), index), (rid, page)

    # --- rules --------------------------------------------------------------------------------------
    @rule(
        stem=st.sampled_from(PROMPT_STEMS),
        stem_len=st.one_of(st.just(12), st.integers(0, 12)),
        suffix=st.lists(st.integers(30, 33), max_size=10),
        chunk=CHUNKS,
        decode=st.integers(0, 8),
    )
    def start(self, stem, stem_len, suffix, chunk, decode):
        prompt = stem[:stem_len] + suffix
        if not prompt:
            prompt = [40]
        rid = f"r{self.next_id}"
        self.next_id += 1
        hit = self.alloc.get_computed_prefix(prompt)
        assert 0 <= hit.num_tokens < len(prompt)
        assert hit.num_tokens % 4 == 0
        event("prefix hit" if hit.num_tokens else "no prefix hit")
        # The reused pages hold exactly this prompt's prefix.
        for spec in self.specs:
            pages = hit.pages[spec.name]
            if spec.is_positional:
                assert len(pages) == hit.num_tokens // 4
                for block, page in enumerate(pages):
                    if page >= 0:
                        content = self.device.get((spec.name, page), {})
                        for position in range(block * 4, block * 4 + 4):
                            assert content.get(position) == prompt[position], (spec.name, block, page)
                    else:
                        assert spec.name == "sliding" and (block + 1) * 4 <= hit.num_tokens - (spec.window - 1)
            elif hit.num_tokens:
                for index, page in enumerate(pages):
                    assert self.device.get(("budget", page)) == ("budget", tuple(prompt[: hit.num_tokens]), index)
        first = prompt[hit.num_tokens : hit.num_tokens + chunk]
        before = fingerprint(self.alloc)
        try:
            predicted = self.alloc.can_allocate(rid, len(first), hit)
        except RequestTooLargeError:
            predicted = "too large"
        assert fingerprint(self.alloc) == before
        try:
            allocation = self.alloc.allocate(rid, first, prefix_hit=hit)
        except RequestTooLargeError:
            assert predicted == "too large"
            assert fingerprint(self.alloc) == before
            return
        assert (allocation is not None) == predicted
        if allocation is None:
            event("allocate failed: pool full")
            assert fingerprint(self.alloc) == before
            return
        self.apply_copies(allocation.copies)
        assert hit.num_tokens <= hit.shared_prefix_tokens < len(prompt)
        self.requests[rid] = {
            "tokens": list(prompt),
            "prompt_len": len(prompt),
            "computed": hit.num_tokens,
            "decode": decode,
            "shared": hit.shared_prefix_tokens,
            "hit": hit.num_tokens,
        }
        if hit.num_tokens and allocation.copies:
            # The copied snapshot is the request's starting state.
            for index, page in enumerate(self.alloc.block_tables(rid)["budget"][: len(allocation.copies)]):
                assert self.device[("budget", page)] == ("budget", tuple(prompt[: hit.num_tokens]), index)
        self.finish_step(rid, len(first))

    def finish_step(self, rid, num_new):
        request = self.requests[rid]
        positions = range(request["computed"], request["computed"] + num_new)
        self.write_step(rid, positions)
        result = self.alloc.commit(rid)
        if result.copies:
            event("budgeted snapshot stored")
        request["computed"] += num_new
        self.stamp_budget_pages(rid)
        self.apply_copies(result.copies)
        for copy in result.copies:  # snapshot pages hold the state just computed
            assert self.device[("budget", copy.dst)][1] == tuple(request["tokens"][: request["computed"]])
        self.check_contents(rid)
        tables = self.alloc.block_tables(rid)
        window = SPECS[1].window  # the sliding group
        first_needed = max(0, request["computed"] - (window - 1)) // 4
        # Out of the window: released, except the last window of the shared prefix, which is kept.
        kept = range(max(0, request["shared"] - (window - 1)) // 4, request["shared"] // 4)
        assert all(p == -1 or block in kept for block, p in enumerate(tables["sliding"][:first_needed]))
        assert all(p >= 0 for block, p in enumerate(tables["sliding"][:first_needed]) if block in kept and block >= hit_skipped(request, window))
        assert all(p >= 0 for p in tables["sliding"][first_needed:])
        if "budget" in tables:
            assert len(tables["budget"]) == -(-min(request["computed"], 6) // 4)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), chunk=CHUNKS)
    def step(self, data, chunk):
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        request = self.requests[rid]
        decoding = request["computed"] >= request["prompt_len"] and request["decode"] > 0
        self.advance(rid, chunk, data.draw(st.integers(30, 33)) if decoding else None)

    def advance(self, rid, chunk, decode_token=None):
        """One engine step for `rid`: the next prompt chunk, or one decode token, or finishing."""
        request = self.requests[rid]
        computed = request["computed"]
        if computed < request["prompt_len"]:
            new = request["tokens"][computed : computed + chunk]
        elif request["decode"] > 0:
            request["decode"] -= 1
            request["tokens"].append(decode_token)
            new = [decode_token]
        else:
            self.finish(rid)
            return
        before = fingerprint(self.alloc)
        try:
            predicted = self.alloc.can_allocate(rid, len(new))
            allocation = self.alloc.allocate(rid, new)
        except RequestTooLargeError:
            self.finish(rid)  # the engine would reject it; drop it
            return
        assert (allocation is not None) == predicted
        if allocation is None:
            assert fingerprint(self.alloc) == before
            self.finish(rid)  # preempted
            return
        self.apply_copies(allocation.copies)
        self.finish_step(rid, len(new))

    def finish(self, rid):
        self.alloc.free(rid)
        del self.requests[rid]

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free_one(self, data):
        self.finish(data.draw(st.sampled_from(sorted(self.requests))))

    @rule()
    def clear_cache(self):
        if any(self.alloc.evictable_pages(s.name) for s in self.specs):
            event("cache cleared while holding entries")
        self.alloc.reset_prefix_cache()
        assert all(not self.alloc.evictable_pages(s.name) for s in self.specs)

    # --- invariants ---------------------------------------------------------------------------------
    @invariant()
    def books_balance(self):
        alloc = self.alloc
        alloc.check_invariants()
        for spec in self.specs:
            holders = {}
            for rid in alloc.request_ids:
                for block, page in enumerate(alloc.block_tables(rid)[spec.name]):
                    if page >= 0:
                        holders.setdefault(page, []).append((rid, block))
            for page in range(alloc.layout.num_pages(spec.name)):
                owners = holders.get(page, [])
                assert alloc.page_refcount(spec.name, page) == len(owners)
                if len(owners) > 1:  # shared: only cached positional blocks, at the same block index
                    assert spec.is_positional and len({block for _, block in owners}) == 1
                state = alloc.page_state(spec.name, page)
                assert (state == "live") == bool(owners)
        # A large page is typed exactly while one of its small pages (of its group) is not free.
        free_large = 0
        for large in range(alloc.layout.num_large_pages):
            group = alloc.large_page_group(large)
            if group is None:
                free_large += 1
                for spec in self.specs:
                    per = alloc.layout.pages_per_large(spec.name)
                    assert all(alloc.page_state(spec.name, p) == "free" for p in range(large * per, (large + 1) * per))
            else:
                per = alloc.layout.pages_per_large(group)
                assert any(alloc.page_state(group, p) != "free" for p in range(large * per, (large + 1) * per))
        assert free_large == alloc.num_free_large_pages()
        stats = alloc.stats()
        assert stats.held_bytes == stats.live_bytes + stats.cached_bytes + stats.external_bytes
        assert 0 <= stats.needed_bytes <= stats.live_bytes
        assert stats.internal_bytes >= -1e-6 and stats.waste_bytes >= -1e-6  # nothing counted twice
        # Needed bytes, brute force: every (owner, block) of every page, the neediest owner per page.
        per_page = {}
        for rid in alloc.request_ids:
            tokens = alloc.num_computed_tokens(rid)
            for spec in self.specs:
                for block, page in enumerate(alloc.block_tables(rid)[spec.name]):
                    if page < 0:
                        continue
                    if spec.is_positional:
                        nbytes = spec.needed_bytes_in_block(block, tokens)
                    else:
                        kept = min(tokens, spec.budget)
                        nbytes = max(0, min(spec.tokens_per_page, kept - block * spec.tokens_per_page)) * spec.bytes_per_token
                    per_page[(spec.name, page)] = max(per_page.get((spec.name, page), 0.0), nbytes)
        assert stats.needed_bytes == pytest.approx(sum(per_page.values()))

    def teardown(self):
        for rid in list(self.requests):
            self.finish(rid)
        alloc = self.alloc
        for spec in self.specs:
            assert all(alloc.page_state(spec.name, p) != "live" for p in range(alloc.layout.num_pages(spec.name)))
        alloc.reset_prefix_cache()
        assert alloc.num_free_large_pages() == alloc.layout.num_large_pages  # no leak
        alloc.check_invariants()


class UncachedAllocatorMachine(AllocatorMachine):
    enable_prefix_caching = False

    def teardown(self):
        for rid in list(self.requests):
            self.finish(rid)
        # Without caching, freeing every request frees every large page at once.
        assert self.alloc.num_free_large_pages() == self.alloc.layout.num_large_pages


class RoomyAllocatorMachine(AllocatorMachine):
    num_large_pages = 40


class FreshFirstAllocatorMachine(AllocatorMachine):
    fresh_large_page_first = True


class OnePagePerLargeMachine(UncachedAllocatorMachine):
    """Equal page sizes: a large page is one small page, so shrinking or freeing one page frees (and
    lets another group retype) its large page at once. Without caching nothing is evictable, so
    allocations go through the large-page reservation path."""

    specs = (SPECS[4], SPECS[0], SPECS[1])  # budget first: it reserves before the others
    num_large_pages = 14
    enable_prefix_caching = False

    def __init__(self):
        RuleBasedStateMachine.__init__(self)
        self.alloc = JengaAllocator(self.specs, pool_bytes=64 * self.num_large_pages, enable_prefix_caching=False)
        assert self.alloc.layout.large_page_bytes == 64
        self.device, self.requests, self.next_id = {}, {}, 0


class PositionalAllocatorMachine(AllocatorMachine):
    """Without the budgeted group (whose hits need snapshots) prefix hits are frequent."""

    specs = SPECS[:4]
    num_large_pages = 16


SETTINGS = settings(max_examples=120, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = SETTINGS
TestUncachedAllocatorMachine = UncachedAllocatorMachine.TestCase
TestUncachedAllocatorMachine.settings = settings(SETTINGS, max_examples=40)
TestRoomyAllocatorMachine = RoomyAllocatorMachine.TestCase
TestRoomyAllocatorMachine.settings = settings(SETTINGS, max_examples=60)
TestFreshFirstAllocatorMachine = FreshFirstAllocatorMachine.TestCase
TestFreshFirstAllocatorMachine.settings = settings(SETTINGS, max_examples=40)
TestOnePagePerLargeMachine = OnePagePerLargeMachine.TestCase
TestOnePagePerLargeMachine.settings = settings(SETTINGS, max_examples=80)
TestPositionalAllocatorMachine = PositionalAllocatorMachine.TestCase
TestPositionalAllocatorMachine.settings = settings(SETTINGS, max_examples=80)


def test_regression_reserved_large_page_left_unused():
    """A trace hypothesis found: a deficit reservation reclaimed one of the group's own large pages,
    whose cached slots were already counted, and left a reserved large page typed but empty."""
    machine = AllocatorMachine()
    stem = PROMPT_STEMS[0]
    for suffix in ([30], [], [30, 30, 30]):
        machine.start(chunk=4, decode=0, stem=stem, stem_len=12, suffix=suffix)
        machine.books_balance()
    machine.advance("r0", 4)
    machine.start(chunk=4, decode=0, stem=stem, stem_len=12, suffix=[])
    for rid, chunk in (("r0", 4), ("r0", 4), ("r1", 4)):
        machine.advance(rid, chunk)
        machine.books_balance()
    machine.start(chunk=4, decode=0, stem=stem, stem_len=12, suffix=[])
    for rid, chunk in (("r0", 4), ("r2", 8), ("r2", 4)):
        machine.advance(rid, chunk)
        machine.books_balance()
    machine.teardown()
