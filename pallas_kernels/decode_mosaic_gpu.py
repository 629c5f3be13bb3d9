"""Paged decode attention as a Pallas Mosaic GPU kernel (Hopper, TMA) that gathers pages in-kernel.

Notes: docs/modules.md (`pallas_kernels/decode_mosaic_gpu.py`)."""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from . import _pages

BLOCK_SLOTS = 64  # rows of the WGMMA register layout: one block of pages is [64, D]
ENTRY_ALIGN = 32  # int32 read-list copies must move a multiple of 128 bytes (a warpgroup's worth)
STATS_WIDTH = 32  # row max / row sum padded to 32 floats per row (128-byte copies, 16-byte strides)
DOUBLE_BUFFER_BYTES = 160 << 10
MAX_SMEM_BYTES = 200 << 10
SUPPORTED_PAGE_SIZES = (16, 32, 64)


def mosaic_gpu_module():
    """`jax.experimental.pallas.mosaic_gpu`, or an ImportError naming the backend when this JAX lacks it."""
    try:
        from jax.experimental.pallas import mosaic_gpu as plgpu
    except ImportError as error:  # pragma: no cover - depends on the JAX build
        raise ImportError(
            "backend 'pallas_mosaic_gpu' needs jax.experimental.pallas.mosaic_gpu, which this JAX "
            f"({jax.__version__}) does not provide: {error}"
        ) from error
    for name in ("kernel", "copy_gmem_to_smem", "copy_smem_to_gmem", "barrier_wait", "SMEM", "Barrier", "Layout"):
        if not hasattr(plgpu, name):
            raise ImportError(f"backend 'pallas_mosaic_gpu': this JAX's plgpu has no {name!r} ({jax.__version__})")
    return plgpu


def has_mosaic_gpu() -> bool:
    try:
        mosaic_gpu_module()
    except ImportError:
        return False
    return True


def gpu_interpret_params():
    """Mosaic GPU interpret-mode params (`InterpretGPUParams()`), or None where this JAX has none."""
    try:
        plgpu = mosaic_gpu_module()
    except ImportError:
        return None
    params_cls = getattr(plgpu, "InterpretGPUParams", None) or getattr(plgpu, "InterpretParams", None)
    if params_cls is None:
        try:  # JAX 0.10: private only
            from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams as params_cls
        except ImportError:
            return None
    return params_cls()


def _layouts(plgpu):
    """(2-D block layout, its row vector layout, its column vector layout) of the WGMMA register layout."""
    block = plgpu.Layout.WGMMA
    if hasattr(block, "reduce"):
        return block, block.reduce(1), block.reduce(0)
    return block, plgpu.Layout.WGMMA_ROW, plgpu.Layout.WGMMA_COL  # older JAX spelled them out


def _kernel_entry(plgpu, body, out_type, scratch, **kwargs):
    """`plgpu.kernel` across versions: `out_type`/`scratch_types` (0.10+) or `out_shape`/`scratch_shapes`."""
    params = inspect.signature(plgpu.kernel).parameters
    out_key = "out_type" if "out_type" in params else "out_shape"
    scratch_key = "scratch_types" if "scratch_types" in params else "scratch_shapes"
    return plgpu.kernel(body, **{out_key: out_type, scratch_key: scratch}, **kwargs)


def _barrier(barriers, index):
    """One barrier of an allocation: JAX 0.10 gives `Barrier(num_barriers=1)` a shape of (1,), JAX 0.11 and
    later a scalar ref, which `.at[0]` no longer indexes."""
    return barriers.at[index] if barriers.shape else barriers


def _decode_body(
    q_ref, physical_ref, counts_ref, blocks_ref, k_ref, v_ref,  # inputs, GMEM
    acc_ref, stats_ref,  # outputs, GMEM
    q_smem, physical_smem, counts_smem, blocks_smem, k_smem, v_smem, acc_smem, stats_smem, in_barrier, kv_barrier,
    *, plgpu, page_size: int, q_per_row: int, num_buffers: int, interpreting: bool,
):
    # q_ref f32[R, G, D] (scaled); physical_ref, counts_ref int32[S, R, Es]; blocks_ref int32[S, R, 32]
    # (active blocks of the split in [..., 0]); k_ref, v_ref [N, ps, D]; acc_ref f32[S, R, G, D];
    # stats_ref f32[S, R, 2, 32] (row max, row sum).
    block_layout, row_layout, col_layout = _layouts(plgpu)

    def load(ref, layout):
        if interpreting:  # the interpreter implements neither plgpu.load nor layout_cast
            return ref[...]
        return plgpu.load(ref, (), layout=layout, optimized=False)

    def cast(x, layout):
        return x if interpreting else plgpu.layout_cast(x, layout)

    row, split = lax.axis_index("row"), lax.axis_index("split")
    pages_per_block = BLOCK_SLOTS // page_size
    head_dim = q_smem.shape[-1]
    plgpu.copy_gmem_to_smem(q_ref.at[row], q_smem, _barrier(in_barrier, 0))
    plgpu.copy_gmem_to_smem(physical_ref.at[split, row], physical_smem, _barrier(in_barrier, 0))
    plgpu.copy_gmem_to_smem(counts_ref.at[split, row], counts_smem, _barrier(in_barrier, 0))
    plgpu.copy_gmem_to_smem(blocks_ref.at[split, row], blocks_smem, _barrier(in_barrier, 0))
    plgpu.barrier_wait(_barrier(in_barrier, 0))
    num_blocks = blocks_smem[0]

    def fetch(block, buffer):
        # Every page of the block is copied (entries without slots point at a valid page, masked below),
        # so the barrier always sees 2 * pages_per_block arrivals.
        for j in range(pages_per_block):
            page = physical_smem[block * pages_per_block + j]
            rows = pl.ds(j * page_size, page_size)
            plgpu.copy_gmem_to_smem(k_ref.at[page], k_smem.at[buffer, rows], _barrier(kv_barrier, buffer))
            plgpu.copy_gmem_to_smem(v_ref.at[page], v_smem.at[buffer, rows], _barrier(kv_barrier, buffer))

    @pl.when(num_blocks > 0)
    def _():
        fetch(0, 0)

    queries = [load(q_smem.at[g], col_layout) for g in range(q_per_row)]
    slot = cast(lax.broadcasted_iota(jnp.int32, (BLOCK_SLOTS,), 0), row_layout)

    # Double buffering: block i+1 is fetched into the buffer block i-1 used. The thread that issues the
    # TMA copies gets there only after block i-1's cross-warp reductions (max and sums over the 64 rows,
    # which span the 4 warps), i.e. after every warp has read that buffer into registers.
    def fold_block(block, state):
        buffer = lax.rem(block, num_buffers) if num_buffers > 1 else 0
        if num_buffers > 1:
            @pl.when(block + 1 < num_blocks)
            def _():
                fetch(block + 1, 1 - buffer)

        plgpu.barrier_wait(_barrier(kv_barrier, buffer))
        k = load(k_smem.at[buffer], block_layout).astype(jnp.float32)  # [64, D]
        v = load(v_smem.at[buffer], block_layout).astype(jnp.float32)
        valid = slot < 0
        for j in range(pages_per_block):  # slot t is valid when t % ps < count of its page
            count = counts_smem[block * pages_per_block + j]
            valid = valid | ((slot >= j * page_size) & (slot < j * page_size + count))
        v = jnp.where(lax.broadcast_in_dim(valid, v.shape, (0,)), v, 0.0)  # unused slots may hold NaN
        new_state = []
        for g in range(q_per_row):
            row_max, row_sum, acc = state[g]
            logits = jnp.sum(k * lax.broadcast_in_dim(queries[g], k.shape, (1,)), axis=1)  # [64]
            logits = jnp.where(valid, logits, -jnp.inf)
            new_max = jnp.maximum(row_max, jnp.max(logits))  # finite: an active block has a valid slot
            rescale = jnp.exp(row_max - new_max)
            probs = jnp.exp(logits - new_max)
            weighted = jnp.sum(lax.broadcast_in_dim(probs, v.shape, (0,)) * v, axis=0)  # [D]
            new_state.append((new_max, rescale * row_sum + jnp.sum(probs), rescale * acc + weighted))
        if num_buffers == 1:  # single buffer: refill it only after this block's cross-warp reductions
            @pl.when(block + 1 < num_blocks)
            def _():
                fetch(block + 1, 0)
        return tuple(new_state)

    zeros = cast(jnp.zeros((head_dim,), jnp.float32), col_layout)
    state = tuple((jnp.float32(-jnp.inf), jnp.float32(0.0), zeros) for _ in range(q_per_row))
    state = lax.fori_loop(0, num_blocks, fold_block, state)
    for g, (row_max, row_sum, acc) in enumerate(state):
        acc_smem[g] = acc
        stats_smem[0, g] = row_max
        stats_smem[1, g] = row_sum
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(acc_smem, acc_ref.at[split, row])
    plgpu.copy_smem_to_gmem(stats_smem, stats_ref.at[split, row])
    plgpu.wait_smem_to_gmem(0)


def check_mosaic_gpu_shapes(page_size: int, head_dim: int, itemsize: int) -> int:
    """Validate the layout constraints (module docstring); returns the number of SMEM page buffers."""
    if page_size not in SUPPORTED_PAGE_SIZES:
        raise ValueError(f"pallas_mosaic_gpu needs page_size in {SUPPORTED_PAGE_SIZES}, got {page_size}")
    if head_dim % 32:
        raise ValueError(f"pallas_mosaic_gpu needs head_dim a multiple of 32, got {head_dim}")
    buffer_bytes = 2 * BLOCK_SLOTS * head_dim * itemsize  # K and V of one block
    if 2 * buffer_bytes <= DOUBLE_BUFFER_BYTES:
        return 2
    if buffer_bytes <= MAX_SMEM_BYTES:
        return 1
    raise ValueError(
        f"pallas_mosaic_gpu: a 64-slot block of K and V ({buffer_bytes} bytes for head_dim {head_dim}) "
        f"does not fit the {MAX_SMEM_BYTES}-byte SMEM budget"
    )


def attend_read_list_mosaic_gpu(
    q,  # [B, Hq, D]
    k_pages,  # [N, ps, D]
    v_pages,  # [N, ps, D]
    physical,  # int32[B, Hsel, E]  physical page of each entry
    counts,  # int32[B, Hsel, E]  valid slots per entry (entry 0 current page, full pages, then count 0)
    *,
    sm_scale: float,
    interpret=False,
    pages_per_block: int | None = None,
    num_splits: int | None = None,
    k_scale=None,
    v_scale=None,
):
    """The read-list contract of `attend_read_list_xla`, on the Mosaic GPU kernel.

    interpret: False compiles for the GPU; True or an `InterpretGPUParams` runs Mosaic GPU's interpret
    mode (CPU). pages_per_block: must be None or 64 // page_size (fixed by the layout).
    Returns (out f32[B, Hq, D], row_max f32[B, Hq], row_sum f32[B, Hq]).
    """
    plgpu = mosaic_gpu_module()
    if k_scale is not None or v_scale is not None:
        raise NotImplementedError("backend 'pallas_mosaic_gpu' does not support int8 pages (k_scale/v_scale)")
    if k_pages.dtype not in (jnp.float32, jnp.bfloat16):
        raise ValueError(f"pallas_mosaic_gpu needs float32 or bfloat16 pages, got {k_pages.dtype}")
    batch, num_q_heads, head_dim = q.shape
    page_size = k_pages.shape[1]
    num_sel_heads, num_entries = physical.shape[1:]
    q_per_row = num_q_heads // num_sel_heads
    rows = batch * num_sel_heads
    num_buffers = check_mosaic_gpu_shapes(page_size, head_dim, jnp.dtype(k_pages.dtype).itemsize)
    block_pages = BLOCK_SLOTS // page_size
    if pages_per_block is not None and pages_per_block != block_pages:
        raise ValueError(
            f"pallas_mosaic_gpu reads blocks of {BLOCK_SLOTS} slots: pages_per_block must be None or "
            f"{block_pages} for page_size {page_size}, got {pages_per_block}"
        )
    if interpret is True:
        interpret = gpu_interpret_params()
        if interpret is None:
            raise NotImplementedError("backend 'pallas_mosaic_gpu': this JAX has no Mosaic GPU interpret mode")
    interpreting = interpret not in (False, None)

    num_blocks = _pages.cdiv(num_entries, block_pages)
    if num_splits is None:  # enough CUDA blocks for H100's 132 SMs when rows are few (untuned)
        num_splits = max(1, min(num_blocks // 4, 132 // max(1, rows)))
    num_splits = max(1, min(num_splits, num_blocks))
    blocks_per_split = _pages.cdiv(num_blocks, num_splits)
    entries_per_split = _pages.cdiv(blocks_per_split * block_pages, ENTRY_ALIGN) * ENTRY_ALIGN
    padded = num_splits * entries_per_split
    physical = _pages.pad_axis(physical.reshape(rows, num_entries), padded, axis=1, value=0)
    counts = _pages.pad_axis(counts.reshape(rows, num_entries), padded, axis=1, value=0)
    # split s takes blocks s, s+S, s+2S, ...: the entries with slots stay a prefix of every split
    physical = _interleave(physical, num_splits, block_pages)  # [S, R, Es]
    counts = _interleave(counts, num_splits, block_pages)
    active_blocks = _pages.cdiv(jnp.sum(counts > 0, axis=-1, dtype=jnp.int32), block_pages)  # [S, R]
    active_blocks = jnp.broadcast_to(active_blocks[..., None], (num_splits, rows, ENTRY_ALIGN)).astype(jnp.int32)
    q_rows = (q.astype(jnp.float32) * sm_scale).reshape(rows, q_per_row, head_dim)

    body = functools.partial(
        _decode_body, plgpu=plgpu, page_size=page_size, q_per_row=q_per_row, num_buffers=num_buffers,
        interpreting=interpreting,
    )
    kernel = _kernel_entry(
        plgpu,
        body,
        (
            jax.ShapeDtypeStruct((num_splits, rows, q_per_row, head_dim), jnp.float32),
            jax.ShapeDtypeStruct((num_splits, rows, 2, STATS_WIDTH), jnp.float32),
        ),
        [
            plgpu.SMEM((q_per_row, head_dim), jnp.float32),
            plgpu.SMEM((entries_per_split,), jnp.int32),
            plgpu.SMEM((entries_per_split,), jnp.int32),
            plgpu.SMEM((ENTRY_ALIGN,), jnp.int32),
            plgpu.SMEM((num_buffers, BLOCK_SLOTS, head_dim), k_pages.dtype),
            plgpu.SMEM((num_buffers, BLOCK_SLOTS, head_dim), v_pages.dtype),
            plgpu.SMEM((q_per_row, head_dim), jnp.float32),
            plgpu.SMEM((2, STATS_WIDTH), jnp.float32),
            plgpu.Barrier(num_arrivals=4),
            plgpu.Barrier(num_arrivals=2 * block_pages, num_barriers=num_buffers),
        ],
        grid=(rows, num_splits),
        grid_names=("row", "split"),
        compiler_params=plgpu.CompilerParams(),
        **({"interpret": interpret} if interpreting else {}),
    )
    acc, stats = kernel(q_rows, physical, counts, active_blocks, k_pages, v_pages)
    acc = acc.reshape(num_splits, batch, num_q_heads, head_dim)
    row_max = stats[:, :, 0, :q_per_row].reshape(num_splits, batch, num_q_heads)
    row_sum = stats[:, :, 1, :q_per_row].reshape(num_splits, batch, num_q_heads)
    if num_splits == 1:
        return acc[0] / row_sum[0][..., None], row_max[0], row_sum[0]
    return _pages.merge_partials(acc, row_max, row_sum)


def _interleave(entries, num_splits: int, block_pages: int):
    """[R, S * Es] -> [S, R, Es] where split s holds blocks s, s+S, s+2S, ... of the row, in order."""
    rows, total = entries.shape
    per_split = total // (num_splits * block_pages)
    entries = entries.reshape(rows, per_split, num_splits, block_pages)
    return jnp.transpose(entries, (2, 0, 1, 3)).reshape(num_splits, rows, per_split * block_pages)
