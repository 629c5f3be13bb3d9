"""The pool's byte layout: one flat buffer of equal large pages, each split into small pages of one group.

`choose_large_page_bytes` picks the large page size (the LCM of the small page sizes, or a bounded
multiple of the largest when the LCM is huge); `PoolLayout` maps (group, small page id) to byte offsets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from kvjax.jenga.specs import GroupSpec, validate_group_specs


def choose_large_page_bytes(page_bytes: Sequence[int], max_ratio: int = 8) -> int:
    """Large page size in bytes for small pages of the given sizes.

    The LCM of the sizes when it is at most `max_ratio` times the largest size: every large page then
    splits into whole small pages of any group with no slack. Otherwise (e.g. 2 MiB and 352 KiB pages have
    an LCM of 22 MiB) a bounded multiple k * max(page_bytes), k in 1..max_ratio, whose worst-case tail
    slack (bytes left over after the whole small pages of a group) is smallest; ties go to the smaller k.
    Large pages this big cost more in partly used large pages, which is why they are bounded; the
    benchmark measures the rules against each other (eval/bench_serving.py --large-page-rule).
    """
    sizes = [int(b) for b in page_bytes]
    if not sizes or any(b <= 0 for b in sizes):
        raise ValueError(f"page_bytes must be positive sizes, got {list(page_bytes)}")
    if max_ratio < 1:
        raise ValueError(f"max_ratio must be >= 1, got {max_ratio}")
    largest = max(sizes)
    lcm = math.lcm(*sizes)
    if lcm <= max_ratio * largest:
        return lcm

    def worst_slack(large: int) -> float:
        return max((large % size) / large for size in sizes)

    return min((k * largest for k in range(1, max_ratio + 1)), key=lambda large: (worst_slack(large), large))


@dataclass(frozen=True)
class PoolLayout:
    """Byte layout of the pool: `num_large_pages` large pages of `large_page_bytes` each.

    Small page p of group g lives in large page p // pages_per_large[g] at byte offset
    (p % pages_per_large[g]) * page_bytes[g] inside it, so a group's pages are numbered
    0 .. num_large_pages * pages_per_large[g] - 1 and the typed view of the group is a reshape of the pool
    (kvjax.jenga.views). Bytes past the last whole small page of a large page are tail slack.
    """

    specs: tuple[GroupSpec, ...]
    large_page_bytes: int
    num_large_pages: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "specs", validate_group_specs(self.specs))
        if self.num_large_pages <= 0:
            raise ValueError(f"num_large_pages must be positive, got {self.num_large_pages}")
        for spec in self.specs:
            if spec.page_bytes > self.large_page_bytes:
                raise ValueError(
                    f"group {spec.name!r}: small page of {spec.page_bytes} bytes does not fit a large page of "
                    f"{self.large_page_bytes} bytes"
                )

    @classmethod
    def from_pool_bytes(
        cls,
        specs: Sequence[GroupSpec],
        pool_bytes: int,
        large_page_bytes: int | None = None,
        max_ratio: int = 8,
    ) -> "PoolLayout":
        """The layout with as many large pages as fit in `pool_bytes`.

        `large_page_bytes` defaults to choose_large_page_bytes(small page sizes, max_ratio).
        """
        specs = validate_group_specs(specs)
        if large_page_bytes is None:
            large_page_bytes = choose_large_page_bytes([s.page_bytes for s in specs], max_ratio)
        num_large = pool_bytes // large_page_bytes
        if num_large <= 0:
            raise ValueError(
                f"pool of {pool_bytes} bytes holds no large page of {large_page_bytes} bytes "
                f"(small pages: {', '.join(f'{s.name}={s.page_bytes}' for s in specs)})"
            )
        return cls(specs, large_page_bytes, num_large)

    # --- sizes ----------------------------------------------------------------------------------------
    @property
    def pool_bytes(self) -> int:
        return self.large_page_bytes * self.num_large_pages

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.specs)

    def group_index(self, group: str | int) -> int:
        """Index of a group given its name (or its index, checked)."""
        if isinstance(group, int) and not isinstance(group, bool):
            if not 0 <= group < len(self.specs):
                raise KeyError(f"group index {group} out of range for {len(self.specs)} groups")
            return group
        for index, spec in enumerate(self.specs):
            if spec.name == group:
                return index
        raise KeyError(f"unknown group {group!r}; groups are {list(self.group_names)}")

    def spec(self, group: str | int) -> GroupSpec:
        return self.specs[self.group_index(group)]

    def pages_per_large(self, group: str | int) -> int:
        """How many small pages of `group` one large page holds."""
        return self.large_page_bytes // self.spec(group).page_bytes

    def num_pages(self, group: str | int) -> int:
        """Size of the group's page-id space (every large page typed as this group)."""
        return self.num_large_pages * self.pages_per_large(group)

    def tail_slack_bytes(self, group: str | int) -> int:
        """Bytes a large page of this group leaves unused after its whole small pages."""
        return self.large_page_bytes - self.pages_per_large(group) * self.spec(group).page_bytes

    # --- addresses ------------------------------------------------------------------------------------
    def locate(self, group: str | int, page_id: int) -> tuple[int, int]:
        """(large page, byte offset inside it) of small page `page_id` of `group`."""
        per_large = self.pages_per_large(group)
        if not 0 <= page_id < self.num_large_pages * per_large:
            raise IndexError(
                f"page id {page_id} out of range for group {self.spec(group).name!r} "
                f"(0..{self.num_large_pages * per_large - 1})"
            )
        large, slot = divmod(page_id, per_large)
        return large, slot * self.spec(group).page_bytes

    def byte_offset(self, group: str | int, page_id: int) -> int:
        """Offset of small page `page_id` of `group` in the flat pool."""
        large, offset = self.locate(group, page_id)
        return large * self.large_page_bytes + offset

    def page_id(self, group: str | int, large_page: int, slot: int) -> int:
        """Inverse of locate: the id of slot `slot` of `large_page` when typed as `group`."""
        return large_page * self.pages_per_large(group) + slot
