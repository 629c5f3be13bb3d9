"""A prefilled (and compressed) `KVState` saved to a directory and loaded back to decode from: the pages in
use with their metadata and the policy's, under a JSON header naming the model, the policy and the layout.

Notes: docs/modules.md (`kvjax/engine/saved_state.py`)."""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.cache.state import EMPTY_PAGE, CacheCapacityError, KeySketch, KVState, init_state, pages_for
from kvjax.engine.api import as_token_row, policy_or_full
from kvjax.engine.generation import continue_rows, feed_tokens
from kvjax.engine.step import LOCAL_BACKEND, StepBackend
from kvjax.models.loading import Model
from kvjax.policies import POLICY_REGISTRY, Policy, layer_roles
from kvjax.util.tensor_file import (
    CHECKSUMS, TensorFileError, aligned_empty, file_checksum, read_all, read_small, tensor_index,
)
from kvjax.util.trees import copied

FORMAT, VERSION = "kvjax.saved_state", 2
READS = (1, 2)  # versions read: 2 is checked by xxh3-64, which a reader of 1 would not check
HEADER_FILE, TENSOR_FILE = "header.json", "state.safetensors"
# per-page fields (the scales only exist for int8 pages) and per-sequence fields, as stored
PAGE_FIELDS = ("k_pages", "v_pages", "kmin", "kmax", "slot_pos", "slot_score", "k_scale", "v_scale")
POOL_TENSORS = (*PAGE_FIELDS, "key_sketch.codes")  # tensors with a row per saved page
ROW_FIELDS = ("page_table", "lengths", "hole", "next_position")


class SavedStateError(ValueError):
    """A saved state refused: names the directory and what does not match (nothing is loaded)."""


class SavedState(NamedTuple):
    """What `load_state` returns: the `state` (B sequences, room for `room` more tokens each; on a mesh stacked
    per shard), the `policy` that continues it, the `logits f32[B, V]` at each prompt's last token (None if not
    saved), the header and the `backend` whose steps continue it (one device, or a mesh's). Loaded with
    `pad_rows` onto a data axis B does not divide, `state` and `logits` hold B' > B rows, the extra ones copies
    of the first sequence (`held_rows`), which `question_fed` feeds and `generate_from_state` drops. `once`
    (`load_state(once=True)`): the state answers one question, decode taking over its buffers (no copy)."""

    state: KVState
    policy: Policy
    logits: jax.Array | None
    room: int
    header: dict
    backend: StepBackend = LOCAL_BACKEND
    once: bool = False


# ------------------------------------------------------------------------------------------ identities


def _set_fields(config: Any) -> Any:
    """A config dataclass as a dict of the fields that differ from their defaults (nested alike), so a field
    a later kvjax adds, at its default, leaves the identity of existing models unchanged."""
    if not dataclasses.is_dataclass(config):
        return config
    out = {}
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
        if value != default:
            out[field.name] = _set_fields(value)
    return out


def model_identity(model: Model, name: str | None = None) -> dict:
    """The model a state belongs to: a hash of its config (the fields set) and a fingerprint of its weights
    (their count, dtypes and total magnitude, and the first embedding values): a fine-tuned copy of one
    config is told apart, whichever layout (stacked or per layer) holds the parameters."""
    cached = model.__dict__.get("_saved_state_identity")  # computed once per parameter tree
    if cached is not None and cached[0] is model.params:
        return dict(cached[1], name=name)
    config = json.dumps(_set_fields(model.cfg), sort_keys=True, default=str).encode()
    leaves = jax.tree_util.tree_flatten_with_path(model.params)[0]
    mass = sum(_magnitude(leaf) for _, leaf in leaves)
    dtypes = sorted({jnp.dtype(leaf.dtype).name for _, leaf in leaves})
    embedding = [leaf for path, leaf in leaves if "embed" in jax.tree_util.keystr(path)]
    sample = np.asarray(embedding[0]).reshape(-1)[:64].astype(np.float32).tobytes() if embedding else b""
    weights = f"{sum(leaf.size for _, leaf in leaves)}|{dtypes}|{mass:.4e}".encode() + sample
    identity = {"name": name, "config_hash": hashlib.blake2b(config, digest_size=16).hexdigest(),
                "weights_fingerprint": hashlib.blake2b(weights, digest_size=16).hexdigest(),
                "dtype": jnp.dtype(model.dtype).name}
    model.__dict__["_saved_state_identity"] = (model.params, identity)
    return identity


def _magnitude(leaf, block: int = 1 << 18) -> float:
    """The sum of `|x|` over a parameter array, in float64, taken a block at a time (no temporary as large as
    the array: on a fresh process, the first load's identity costs a read of the weights, no more)."""
    flat = np.asarray(leaf).reshape(-1)
    buffer = np.empty(min(block, flat.size), np.float32)
    total = 0.0
    for at in range(0, flat.size, block):
        part = buffer[: min(block, flat.size - at)]
        total += float(np.abs(flat[at : at + part.size], out=part).sum(dtype=np.float64))
    return total


def policy_spec(policy: Policy) -> dict:
    """`{"name": ..., field: value, ...}`: the policy's identity (its compared dataclass fields; wrapped
    policies as nested specs). Data fields such as Locret's heads are left out: `policy_from_spec` takes them."""
    spec = {"name": policy.name}
    for field in dataclasses.fields(policy):
        if field.compare:
            value = getattr(policy, field.name)
            spec[field.name] = policy_spec(value) if isinstance(value, Policy) else value
    return spec


def policy_from_spec(spec: dict, **data: Any) -> Policy:
    """The policy `policy_spec` described, with `data` (fields the spec leaves out, e.g. `heads=`) added."""
    options = {k: policy_from_spec(v) if isinstance(v, dict) and "name" in v else v for k, v in spec.items() if k != "name"}
    cls = POLICY_REGISTRY.get(spec["name"])
    if cls is None:
        raise ValueError(f"unknown policy {spec['name']!r}")
    return cls(**options, **data)


def _encode_tree(tree: Any, prefix: str, tensors: dict) -> Any:
    """A pytree of arrays as JSON naming tensors (dicts, tuples and lists kept), its leaves put in `tensors`."""
    if isinstance(tree, dict):
        return {"dict": {k: _encode_tree(v, f"{prefix}.{k}", tensors) for k, v in tree.items()}}
    if isinstance(tree, (tuple, list)):
        return {type(tree).__name__: [_encode_tree(v, f"{prefix}.{i}", tensors) for i, v in enumerate(tree)]}
    tensors[prefix] = np.asarray(tree)
    return {"tensor": prefix}


def _decode_tree(node: dict, tensors: dict) -> Any:
    (kind, value), = node.items()
    if kind == "dict":
        return {k: _decode_tree(v, tensors) for k, v in value.items()}
    if kind in ("tuple", "list"):
        items = [_decode_tree(v, tensors) for v in value]
        return tuple(items) if kind == "tuple" else items
    return tensors[value]


# ------------------------------------------------------------------------------------------ room


def _grows(policy: Policy, layer: int) -> bool:
    """Whether `layer`'s slots grow while decoding (not a layer the policy evicts in at every step)."""
    return not layer_roles(policy, layer).evict


def growth_tokens(policy: Policy, lengths: np.ndarray, room: int) -> np.ndarray:
    """Slots each head of `lengths int[L, B, H]` may add while `room` tokens are appended: `room`, or in a
    layer the policy evicts in, what it takes to reach its decode budget plus the step's new slot."""
    out = np.full(lengths.shape, room, np.int64)
    for l in range(lengths.shape[0]):
        if not _grows(policy, l):
            out[l] = np.clip(policy.evictor.decode_budget + 1 - lengths[l], min(1, room), room)
    return out


def state_room(state: KVState, policy: Policy, context: int) -> int:
    """Tokens every sequence of `state` can still append before a growing layer reaches its read bound (with
    no growing layer: before `context`, the model's positions)."""
    lengths = np.asarray(state.lengths)  # [L, B, H]
    rooms = [state.layer_read_pages(l) * state.page_size - int(lengths[l].max())
             for l in range(lengths.shape[0]) if _grows(policy, l)]
    return max(0, min(rooms) if rooms else context - int(np.max(np.asarray(state.next_position))))


# ------------------------------------------------------------------------------------------ save


def save_state(state: KVState, path: str | os.PathLike, *, model: Model, policy: Policy | None = None,
               logits: jax.Array | None = None, model_name: str | None = None) -> str:
    """Save `state` (a prefill under `policy` of `model`, B sequences, on one device or stacked on a mesh by
    `kvjax.distributed`) into directory `path` (replaced): the pages its tables reference (a pool compacted to
    them, a mesh's shards merged into one), their K/V, scales, min/max, positions and scores, the tables,
    lengths, holes and next positions, a selector's key sketch, and `logits f32[B, V]` (the prefill's, for a
    first token sampled before any question). `header.json` records the model's identity (`model_identity`,
    `model_name` as given to `load_model`), the policy's spec, the layout and the tensors' checksum. Returns
    the path."""
    policy = policy_or_full(policy)
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(state)):
        raise ValueError("save_state takes a concrete state, not one traced inside jit")
    state = whole_state(state)
    if int(state.overflow[0]) != 0:
        raise ValueError("the state overflowed its capacity (state.overflow is set): it holds an incomplete step")
    tensors = _compacted(state)
    if logits is not None:
        tensors["logits"] = np.asarray(logits, np.float32).reshape(state.page_table.shape[1], -1)
    sketch = None if state.key_sketch is None else _encode_tree(state.key_sketch.params, "key_sketch.params", tensors)
    header = {
        "format": FORMAT, "version": VERSION, "model": model_identity(model, model_name),
        "policy": policy_spec(policy), "page_size": state.page_size, "page_dtype": state.page_dtype.name,
        "batch": int(state.page_table.shape[1]), "table_width": state.max_pages,
        "read_pages": None if state.read_pages is None else list(state.read_pages), "long_rope": state.long_rope,
        "pages": int(tensors["slot_pos"].shape[0]), "tokens": tensors["next_position"].tolist(),
        "room": state_room(state, policy, model.cfg.max_position_embeddings), "key_sketch": sketch,
    }
    from safetensors.numpy import save_file

    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".saving-", dir=parent)  # written whole, then moved into place
    try:
        save_file(tensors, os.path.join(staging, TENSOR_FILE))
        written = os.path.join(staging, TENSOR_FILE)
        header["checksum"] = {CHECKSUMS[0]: file_checksum(written), "bytes": os.path.getsize(written)}
        with open(os.path.join(staging, HEADER_FILE), "w") as f:
            json.dump(header, f, indent=1)
        if os.path.isdir(path):
            shutil.rmtree(path)
        os.replace(staging, path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return path


def _compacted(state: KVState) -> dict:
    """The tensors to save of a whole host state: its pool fields taken at the pages its tables reference, in
    order, with the tables renumbered to them; its per-sequence fields; a key sketch's codes."""
    table = state.page_table
    used = np.unique(table[table >= 0])
    remap = np.full(state.num_pages, -1, np.int32)
    remap[used] = np.arange(used.size, dtype=np.int32)
    tensors = {"page_table": np.where(table >= 0, remap[np.maximum(table, 0)], -1).astype(np.int32)}
    for name in PAGE_FIELDS:
        if getattr(state, name) is not None:
            tensors[name] = getattr(state, name)[used]
    for name in ROW_FIELDS[1:]:
        tensors[name] = getattr(state, name)
    if state.key_sketch is not None:
        tensors["key_sketch.codes"] = state.key_sketch.codes[used]
    return tensors


def _host(state: KVState) -> KVState:
    """`state` with numpy leaves; bfloat16 held as such (off CPU): pages as their uint16 bit patterns, their
    metadata as float32 (exact)."""
    host = jax.tree.map(np.asarray, state)
    bfloat16 = {name: getattr(host, name) for name in PAGE_FIELDS
                if getattr(host, name) is not None and getattr(host, name).dtype == jnp.bfloat16}
    return host.replace(**{name: x.view(np.uint16) if name.endswith("pages") else x.astype(np.float32)
                           for name, x in bfloat16.items()})


def whole_state(state: KVState) -> KVState:
    """`state` in host memory (numpy leaves) as one device holds it: a state stacked on a mesh (leaves
    `[Sd, Sm, ...]`, `kvjax.distributed.state`: one pool per shard, rows split over Sd, heads over Sm) merged
    into one pool `[Sd * Sm * N, ...]`, its tables `int32[L, B, H, P]` pointing into each shard's part."""
    host = _host(state)
    if host.page_table.ndim == 4:
        return host
    Sd, Sm, N = host.slot_pos.shape[:3]

    def pool(x):  # [Sd, Sm, N, ...] -> [Sd * Sm * N, ...], shard (d, m) at offset (d * Sm + m) * N
        return x.reshape(Sd * Sm * N, *x.shape[3:])

    def rows_heads(x):  # [Sd, Sm, L, b, h, ...] -> [L, Sd * b, Sm * h, ...]
        return np.concatenate([np.concatenate(list(x[d]), axis=2) for d in range(Sd)], axis=1)

    offsets = (np.arange(Sd * Sm).reshape(Sd, Sm) * N)[:, :, None, None, None, None]
    table = rows_heads(np.where(host.page_table >= 0, host.page_table + offsets, -1))
    refcount = pool(host.refcount)
    free = np.flatnonzero(refcount == 0).astype(np.int32)
    failed = host.overflow.reshape(-1, 3)[host.overflow.reshape(-1, 3)[:, 0] != 0]
    sketch = host.key_sketch
    if sketch is not None:
        sketch = KeySketch(pool(sketch.codes), jax.tree.map(rows_heads, sketch.params))
    return host.replace(
        **{name: pool(getattr(host, name)) for name in PAGE_FIELDS if getattr(host, name) is not None},
        page_table=table, lengths=rows_heads(host.lengths), hole=rows_heads(host.hole),
        next_position=host.next_position[:, 0].reshape(-1), refcount=refcount,
        free_pages=np.concatenate([free, np.flatnonzero(refcount)]).astype(np.int32), num_free=np.int32(free.size),
        overflow=failed[0] if len(failed) else np.zeros(3, np.int32), key_sketch=sketch)


# ------------------------------------------------------------------------------------------ load


def read_header(path: str | os.PathLike) -> dict:
    """The header of the state saved in directory `path`; SavedStateError when missing or not one."""
    file = os.path.join(os.fspath(path), HEADER_FILE)
    try:
        with open(file) as f:
            header = json.load(f)
    except FileNotFoundError:
        raise SavedStateError(f"{path}: no saved state here ({HEADER_FILE} missing)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise SavedStateError(f"{file}: corrupt header ({error})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise SavedStateError(f"{file}: not a kvjax saved state (format {header.get('format') if isinstance(header, dict) else None!r})")
    if header.get("version") not in READS:
        raise SavedStateError(f"{file}: format version {header.get('version')!r}, this kvjax reads versions "
                              f"{', '.join(map(str, READS))}")
    return header


def check_header(path, header: dict, model: Model, page_size: int | None = None, page_dtype=None) -> None:
    """Refuse (SavedStateError, one line) a state of another model, page size or page dtype than asked."""
    saved, ours = header["model"], model_identity(model)
    if saved["config_hash"] != ours["config_hash"]:
        raise SavedStateError(f"{path}: saved for another model ({saved['name'] or 'unnamed'}, config "
                              f"{saved['config_hash']}; this model's config is {ours['config_hash']})")
    if saved["weights_fingerprint"] != ours["weights_fingerprint"]:
        raise SavedStateError(f"{path}: saved for another model's weights ({saved['name'] or 'unnamed'}, "
                              f"{saved['dtype']}): same config, different parameters or dtype")
    if page_size is not None and header["page_size"] != page_size:
        raise SavedStateError(f"{path}: saved with page size {header['page_size']}, page size {page_size} was asked for")
    if page_dtype is not None and header["page_dtype"] != jnp.dtype(page_dtype).name:
        raise SavedStateError(f"{path}: saved with {header['page_dtype']} pages, {jnp.dtype(page_dtype).name} "
                              "pages were asked for")


def continuing_policy(path, header: dict, policy: Policy | None, **policy_data) -> Policy:
    """The policy that continues the saved state: `policy` when it is the one saved (SavedStateError
    otherwise), or the saved spec rebuilt with `policy_data` (fields it leaves out, e.g. Locret's heads)."""
    spec = header["policy"]
    if policy is None:
        try:
            return policy_from_spec(spec, **policy_data)
        except (ValueError, TypeError) as error:
            raise SavedStateError(f"{path}: cannot rebuild policy {spec['name']!r} from the state ({error}); pass "
                                  "policy= or its data fields") from None
    given = policy_spec(policy)
    if json.loads(json.dumps(given, default=str)) != spec:
        raise SavedStateError(f"{path}: saved under policy {spec}, which policy {given} cannot continue from "
                              "(its pages were kept, and its metadata written, for the saved one)")
    return policy


def load_state(path: str | os.PathLike, model: Model, *, policy: Policy | None = None, extra_tokens: int | None = None,
               page_size: int | None = None, page_dtype=None, backend: StepBackend | None = None,
               pad_rows: bool = False, once: bool = False, **policy_data: Any) -> SavedState:
    """Load the state `save_state` wrote into directory `path`, for `model`, with a pool of its pages plus the
    pages `extra_tokens` more tokens per sequence need (default: the room the saved state had), placed where
    `backend`'s steps hold a state: one device (default), or a mesh (`kvjax.distributed.load_state_sharded`:
    each shard its own rows' and heads' pages). Refuses by name, before anything is placed
    (`SavedStateError`): a missing, truncated or corrupt file, another model, another `page_size` or
    `page_dtype` than given, a `policy` other than the saved one; a read bound that `extra_tokens` outgrows is
    widened. On a mesh whose data axis does not divide the saved batch, `pad_rows` pads it with copies of the
    first sequence (refused otherwise). `once`: the state answers one question (`kvjax generate --state`):
    `question_fed` and `generate_from_state` hand its buffers to decode instead of copying them (on XLA:CPU
    the pool is read straight into memory the device owns, which decode can take over), and refuse a second
    question by name; states kept to answer many (the server's) are loaded without it. Returns a `SavedState`."""
    path = os.fspath(path)
    header = read_header(path)
    file = os.path.join(path, TENSOR_FILE)
    expected = header["checksum"]
    size = os.path.getsize(file) if os.path.exists(file) else None
    if size is None:
        raise SavedStateError(f"{path}: {TENSOR_FILE} is missing")
    if size != expected["bytes"]:
        raise SavedStateError(f"{file}: truncated or resized ({size} bytes, saved {expected['bytes']})")
    if not any(kind in expected for kind in CHECKSUMS):
        raise SavedStateError(f"{file}: its header names no checksum this kvjax knows ({sorted(expected)})")
    check_header(path, header, model, page_size, page_dtype)
    policy = continuing_policy(path, header, policy, **policy_data)
    room = header["room"] if extra_tokens is None else extra_tokens
    if room < 0:
        raise ValueError(f"extra_tokens must be >= 0, got {extra_tokens}")
    backend = backend or LOCAL_BACKEND
    placement = backend.placement  # a sharded one (`kvjax.distributed.MeshPlacement`) splits and places shards
    owned = once and not placement.sharded and jax.default_backend() == "cpu"
    try:
        shards, logits, pool = _read_shards(file, header, model.cfg, room, policy,
                                            placement.state_shards() if placement.sharded else (1, 1), expected,
                                            pad_rows, owned)
    except TensorFileError as error:
        raise SavedStateError(str(error)) from None
    if placement.sharded:
        state = placement.place_state(shards)
    else:  # host arrays become the device's as they are (XLA:CPU shares their aligned memory); an owned pool is
        host = shards[0][0]  # the device's already
        if pool is not None:
            codes = pool.pop("key_sketch.codes", None)
            host = host.replace(**pool, key_sketch=None if codes is None else host.key_sketch._replace(codes=codes))
        state = jax.device_put(host)
    return SavedState(state, policy, None if logits is None else backend.put(logits), room, header, backend, once)


@functools.partial(jax.jit, static_argnums=0)
def _empty_pool(layout: tuple[tuple[str, tuple[int, ...], np.dtype], ...]) -> dict:
    """`{name: an array of shape and dtype}` holding empty pages (`EMPTY_PAGE`)."""
    return {name: jnp.full(shape, EMPTY_PAGE.get(name, 0), dtype) for name, shape, dtype in layout}


def _owned_pool(layout: tuple[tuple[str, tuple[int, ...], np.dtype], ...]) -> tuple[dict, dict]:
    """`(arrays, views)`: pool arrays XLA:CPU allocated (empty pages) and writable numpy views of their memory,
    to read the file into before anything else sees them. Decode donates such arrays in place; host memory
    handed to XLA (`jax.device_put`) stays the host's, and a step donated it copies it first."""
    arrays = jax.block_until_ready(_empty_pool(layout))
    if len({x.unsafe_buffer_pointer() for x in arrays.values()}) != len(arrays):  # XLA gives each output its own
        raise RuntimeError("XLA returned one buffer for two pool fields: cannot read the file into them")
    views = {name: np.frombuffer((ctypes.c_byte * x.nbytes).from_address(x.unsafe_buffer_pointer()),
                                 x.dtype).reshape(x.shape) for name, x in arrays.items()}
    return arrays, views


class _Shard(NamedTuple):
    """One shard's part of a saved state: its tensors (the pool's restricted to `pages`, its pages in the
    saved pool, None for all) and its pool's layout."""

    tensors: dict
    pages: np.ndarray | None
    read_pages: tuple | None
    width: int
    num_pages: int  # pages its saved part and its room need


def _shard(header: dict, small: dict, room: int, policy: Policy, rows: slice, heads: slice, whole: bool) -> _Shard:
    tensors = {name: x[:, rows, heads] if name in ("page_table", "lengths", "hole") or name.startswith("key_sketch.params")
               else x[rows] if name == "next_position" else x for name, x in small.items() if name != "logits"}
    pages = None
    if not whole:
        table = tensors["page_table"]
        pages = np.unique(table[table >= 0])
        remap = np.full(header["pages"], -1, np.int32)
        remap[pages] = np.arange(pages.size, dtype=np.int32)
        tensors["page_table"] = np.where(table >= 0, remap[np.maximum(table, 0)], -1).astype(np.int32)
    used = header["pages"] if whole else pages.size
    lengths, ps = tensors["lengths"], header["page_size"]
    grown = pages_for(lengths + growth_tokens(policy, lengths, room), ps)  # [L, B, H] pages each head may reach
    read_pages = header["read_pages"]
    if read_pages is not None:
        read_pages = tuple(max(bound, int(grown[l].max())) if _grows(policy, l) else bound
                           for l, bound in enumerate(read_pages))
    width = max([header["table_width"], int(grown.max())] if read_pages is None else [header["table_width"], *read_pages])
    return _Shard(tensors, pages, read_pages, width, used + int((grown - pages_for(lengths, ps)).sum()))


def _padded(small: dict, pad: int) -> dict:
    """The saved state's small tensors with `pad` copies of sequence 0 after the last (its pages shared)."""
    def rows(name: str, x: np.ndarray) -> np.ndarray:  # every small tensor is per sequence: [B, ...] or [L, B, ...]
        axis = 0 if name in ("next_position", "logits") else 1
        return np.concatenate([x, np.repeat(np.take(x, [0], axis=axis), pad, axis=axis)], axis=axis)
    return {name: rows(name, x) for name, x in small.items()}


def _read_shards(file: str, header: dict, cfg, room: int, policy: Policy, shards: tuple[int, int],
                 expected: dict, pad_rows: bool = False, owned: bool = False,
                 ) -> tuple[list[list[KVState]], np.ndarray | None, dict | None]:
    """The host states (numpy) of each of `shards = (Sd, Sm)` shards, `[d][m]`: rows split over Sd, kv heads
    over Sm, each on a pool of its own pages plus its room, all pools one size; the saved `logits f32[B, V]`
    or None; and with `owned` (one whole state) the device arrays its pool fields view (`_owned_pool`), else
    None. The file is read once, the pool tensors of one whole state straight into its pool; its checksum
    (`expected`'s kind) is checked before anything is returned."""
    kind = next(kind for kind in CHECKSUMS if kind in expected)
    _, entries = tensor_index(file)
    small = read_small(file, entries, [name for name in entries if name not in POOL_TENSORS])
    L, B, H = small["lengths"].shape
    table, ps = small["page_table"], header["page_size"]
    if (table.min(initial=0) < -1 or table.max(initial=-1) >= header["pages"] or small["lengths"].min(initial=0) < 0
            or small["lengths"].max(initial=0) > header["table_width"] * ps):
        value = file_checksum(file, kind)  # before sizing a pool by them: a damaged file, or one not save_state's
        raise SavedStateError(_corrupt(file, kind, value, expected) if value != expected[kind]
                              else f"{file}: corrupt (page table or lengths out of range)")
    Sd, Sm = shards
    if (B % Sd and not pad_rows) or H % Sm:
        raise ValueError(f"a saved state of {B} sequences and {H} kv heads cannot split over {Sd} data and {Sm} "
                         "head shards: each must divide its count (pad_rows=True pads the sequences)")
    # rows over "data": copies of the first sequence fill the last shard (`small` itself is read again below)
    rows = _padded(small, -B % Sd) if B % Sd else small
    B = rows["lengths"].shape[1]
    b, h, whole = B // Sd, H // Sm, Sd * Sm == 1
    parts = [[_shard(header, rows, room, policy, slice(d * b, d * b + b), slice(m * h, m * h + h), whole)
              for m in range(Sm)] for d in range(Sd)]
    N = max(1, *(part.num_pages for row in parts for part in row))
    local = dataclasses.replace(cfg, num_heads=cfg.num_heads // Sm, num_kv_heads=H // Sm)
    width = max(part.width for row in parts for part in row)  # one table width: the shards stack
    template = jax.eval_shape(lambda: init_state(local, b, width * ps, ps, N, jnp.dtype(header["page_dtype"]),
                                                 header["long_rope"]))
    layout = [(name, getattr(template, name).shape, getattr(template, name).dtype) for name in PAGE_FIELDS
              if getattr(template, name) is not None]
    if header["key_sketch"] is not None:
        codes = entries["key_sketch.codes"]
        layout.append(("key_sketch.codes", (N, *codes.shape[1:]), codes.dtype))
    device = None
    if owned and whole:
        device, views = _owned_pool(tuple(layout))
        pools = [[views]]
    else:
        pools = [[{name: aligned_empty(shape, dtype) for name, shape, dtype in layout} for _ in range(Sm)] for _ in range(Sd)]
    used = header["pages"]

    def into(name: str, entry) -> np.ndarray | None:  # one whole state: its saved pool rows read in place
        target = pools[0][0].get(name) if whole else None
        if target is None or target.dtype.itemsize != entry.dtype.itemsize or (
                target.dtype != entry.dtype and target.dtype != jnp.bfloat16):
            return small.get(name)
        return target[:used].view(entry.dtype)

    arrays, value = read_all(file, entries, into, kind)
    if value != expected[kind]:
        raise SavedStateError(_corrupt(file, kind, value, expected))
    states = [[None] * Sm for _ in range(Sd)]
    for d, m in np.ndindex(Sd, Sm):
        part, pool = parts[d][m], pools[d][m]
        states[d][m] = _assembled(header, part, pool, arrays, used if whole else part.pages.size, width, b, h)
    return states, rows.get("logits"), device


def _corrupt(file: str, kind: str, value, expected: dict) -> str:
    return f"{file}: corrupt (checksum {kind} {value}, saved {expected[kind]})"


def _assembled(header: dict, part: _Shard, pool: dict, arrays: dict, used: int, width: int, b: int, h: int) -> KVState:
    """One shard's host state: its pool rows filled (those not read in place copied from `arrays`), the rest
    empty pages, its table widened to `width` and its free stack, refcounts and sketch set."""
    for name, array in pool.items():
        saved = arrays[name]
        if not np.may_share_memory(saved, array):  # not read in place
            if array.dtype == jnp.bfloat16 and saved.dtype == np.uint16:
                saved = saved.view(jnp.bfloat16)
            array[:used] = saved if part.pages is None else saved[part.pages]
        array[used:] = EMPTY_PAGE.get(name, 0)
    tensors = part.tensors
    L = tensors["lengths"].shape[0]
    table = np.full((L, b, h, width), -1, np.int32)
    table[..., : header["table_width"]] = tensors["page_table"]
    N = pool["k_pages"].shape[0]
    refcount = np.bincount(table[table >= 0], minlength=N).astype(np.int32)
    sketch = None
    if header["key_sketch"] is not None:
        sketch = KeySketch(pool.pop("key_sketch.codes"), _decode_tree(header["key_sketch"], tensors))
    return KVState(
        **pool, page_table=table, lengths=tensors["lengths"], hole=tensors["hole"], next_position=tensors["next_position"],
        free_pages=np.concatenate([np.arange(N - 1, used - 1, -1), np.arange(used)]).astype(np.int32),
        num_free=np.int32(N - used), refcount=refcount, overflow=np.zeros((3,), np.int32), key_sketch=sketch,
        long_rope=header["long_rope"], read_pages=part.read_pages,
    )


# ------------------------------------------------------------------------------------------ decode


def question_fed(model: Model, saved: SavedState, question_ids: Sequence[int] | Sequence[Sequence[int]] = (),
                 max_new_tokens: int = 0) -> tuple[KVState, jax.Array]:
    """`(state, logits f32[B, V])`: a copy of the saved state with `question_ids` (one token list for every
    sequence, or one per sequence) fed by decode, as `generate(..., decode_last=N)` feeds a prompt's last N
    tokens. The saved state is not changed, unless loaded with `once`: then decode takes its buffers over (no
    copy) and a second question on it is refused. Raises `CacheCapacityError` before any work when the
    question and `max_new_tokens` more need more than the state's room."""
    rows = question_rows(model, saved, question_ids, max_new_tokens)
    return feed_tokens(model, _decodable(saved), _saved_logits(model, saved, len(rows)), rows, saved.policy,
                       saved.backend)


def _decodable(saved: SavedState) -> KVState:
    """The state a question decodes on: a copy (decode donates its state: the saved one serves many
    questions), or, loaded with `once`, the saved state itself, refused once it has answered."""
    if not saved.once:
        return copied(saved.state)
    if any(x.is_deleted() for x in jax.tree.leaves(saved.state) if isinstance(x, jax.Array)):
        raise ValueError("this saved state was loaded with once=True and has answered its question (decode took "
                         "over its buffers): load it again, or without once to ask it many")
    return saved.state


def _saved_logits(model: Model, saved: SavedState, rows: int) -> jax.Array:
    """The prefill's last logits `f32[rows, V]`, or zeros where none were saved (a question is fed first)."""
    if saved.logits is not None:
        return saved.logits
    return saved.backend.put(np.zeros((rows, model.cfg.vocab_size), np.float32))


def question_rows(model: Model, saved: SavedState, question_ids: Sequence[int] | Sequence[Sequence[int]] = (),
                  max_new_tokens: int = 0) -> list[np.ndarray]:
    """`question_ids` as one `int32[T]` row per held sequence (`held_rows`), checked as `question_fed` checks
    them (vocabulary, one row per sequence, a question where no logits were saved, the state's room)."""
    B = saved.header["batch"]
    held = held_rows(saved)
    rows = list(question_ids)
    rows = [rows] * B if not rows or np.ndim(rows[0]) == 0 else rows
    if len(rows) != B:
        raise ValueError(f"question_ids has {len(rows)} rows but the state holds {B} sequences")
    rows = [as_token_row(r, model.cfg.vocab_size, f"question_ids[{i}]") if len(r) else np.zeros((0,), np.int32)
            for i, r in enumerate(rows)]
    rows += [rows[0]] * (held - B)  # padding rows (`pad_rows`) ask the first sequence's question
    if saved.logits is None and not all(len(r) for r in rows):
        raise ValueError("this state was saved without its prefill logits: give a question to feed first")
    needed = max(len(r) for r in rows) + max_new_tokens
    if needed > saved.room:
        raise CacheCapacityError(
            f"a question of {needed - max_new_tokens} tokens and {max_new_tokens} new tokens need room for {needed} "
            f"tokens, the loaded state has room for {saved.room}; load it with extra_tokens={needed}",
            pages_for(needed, saved.state.page_size), pages_for(saved.room, saved.state.page_size))
    return rows


def generate_from_state(model: Model, saved: SavedState, question_ids: Sequence[int] | Sequence[Sequence[int]] = (),
                        max_new_tokens: int = 32, **sampling: Any):
    """Feed `question_ids` to a copy of the saved state (with `once`, to the state itself) and sample up to
    `max_new_tokens`, in one decode program (`continue_rows`):
    `int32[B, max_new_tokens]`, as `generate` returns (`sampling`: `continue_rows`'s options)."""
    rows = question_rows(model, saved, question_ids, max_new_tokens)
    result = continue_rows(model, _decodable(saved), _saved_logits(model, saved, len(rows)), rows, max_new_tokens,
                           saved.policy, backend=saved.backend, **sampling)
    B = saved.header["batch"]  # padding rows dropped
    return tuple(x[:B] for x in result) if isinstance(result, tuple) else result[:B]


def held_rows(saved: SavedState) -> int:
    """Sequences `saved.state` holds: the saved batch, plus padding rows when loaded with `pad_rows`."""
    table = saved.state.page_table  # [L, B, H, P], or [Sd, Sm, L, b, H, P] stacked on a mesh
    return table.shape[1] if table.ndim == 4 else table.shape[0] * table.shape[3]


__all__ = ["SavedState", "SavedStateError", "generate_from_state", "held_rows", "load_state", "model_identity",
           "policy_from_spec", "policy_spec", "question_fed", "question_rows", "read_header", "save_state"]
