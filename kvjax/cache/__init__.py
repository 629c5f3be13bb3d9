"""The paged KV cache: the immutable state (`state`), page operations (`compaction`), batch rows (`rows`)
and attention over pages (`attention`). Knows no policy and no model."""
