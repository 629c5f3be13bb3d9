"""Policy options given as text (the command line's `--policy-option KEY=VALUE`), parsed by the field's type.

`parse_policy_options("quest", ["token_budget=64"])` -> `{"token_budget": 64}`; a value that does not
read as the field's type raises `ValueError` naming the policy, the option and the expected type.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Iterable

from kvjax.policies.base import POLICY_REGISTRY

_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise ValueError("not a boolean")


_PARSERS = {int: int, float: float, str: str, bool: _parse_bool}


def _candidates(annotation: Any) -> tuple[list, bool]:
    """The concrete types an annotation admits, and whether it admits None (`int | None`, `Optional[int]`)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        return [a for a in args if a is not type(None)], type(None) in args
    return [annotation], False


def parse_value(text: str, annotation: Any) -> Any:
    """`text` read as `annotation` (int, float, bool, str, optionally `| None`); anything else stays text."""
    kinds, optional = _candidates(annotation)
    if optional and text.strip().lower() in ("none", "null", ""):
        return None
    for kind in kinds:
        parser = _PARSERS.get(kind)
        if parser is None:
            return text  # Any, a policy, a path: the policy itself validates it
        try:
            return parser(text)
        except ValueError:
            continue
    raise ValueError(" or ".join(k.__name__ for k in kinds) + (" or none" if optional else ""))


def parse_policy_options(name: str, pairs: Iterable[str]) -> dict[str, Any]:
    """`["KEY=VALUE", ...]` -> options for `make_policy(name, **options)`, each parsed by its option's type
    (`Policy.option_types`: the dataclass fields, or a wrapper's and its parts')."""
    cls = POLICY_REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; registered: {', '.join(sorted(POLICY_REGISTRY))}")
    raw = {}
    for pair in pairs:
        if "=" not in pair:
            raise ValueError(f"policy option {pair!r} must be KEY=VALUE")
        key, value = (part.strip() for part in pair.split("=", 1))
        raw[key] = value
    types = cls.option_types(raw)
    options = {}
    for key, value in raw.items():
        if key not in types:
            raise ValueError(f"policy {name!r} has no option {key!r}; options: {', '.join(sorted(types))}")
        try:
            options[key] = parse_value(value, types[key])
        except ValueError as error:
            raise ValueError(f"policy {name!r} option {key}={value!r}: expected {error}") from None
    return options


def parse_spec(spec: "str | dict | None", *, page_size: int = 16, options: Iterable[str] = (),
               defaults: dict[str, Any] | None = None):
    """The one policy-spec grammar (the command line, `kvjax serve`'s `kv_policy`, eval's sweeps) -> a
    validated `Policy`.

    `spec` is `NAME[:KEY=VALUE,...]`, an evict+select composition `EVICT+SELECT` of two such parts
    (`snapkv:token_budget=128+quest:token_budget=64`), a dict `{"name": NAME, KEY: VALUE, ...}` (JSON), or
    None (full attention). `options` (`["KEY=VALUE", ...]`, `--policy-option`) add to a one-part spec;
    `defaults` fill the fields each part has and its spec leaves out (a sweep's budget; `full` takes none).
    The policy is validated against the `page_size` its cache will use. ValueError names the bad part."""
    from kvjax.policies.base import make_policy

    defaults = dict(defaults or {})
    options = list(options)
    if spec is None:
        spec = "full"
    if isinstance(spec, dict):
        fields = dict(spec)
        name = fields.pop("name", None)
        if not isinstance(name, str):
            raise ValueError('a policy given as an object needs "name", e.g. {"name": "quest", "token_budget": 256}')
        policy = _with_defaults(name, {**fields, **parse_policy_options(name, options)}, defaults)
    elif not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a policy spec is NAME[:KEY=VALUE,...] or EVICT+SELECT, got {spec!r}")
    elif "+" in spec:
        if options:
            raise ValueError(f"policy {spec!r} composes two parts: give their options inside the spec "
                             "(snapkv:token_budget=128+quest:token_budget=64), not as separate options")
        parts = spec.split("+")
        if len(parts) != 2:
            raise ValueError(f"policy {spec!r}: a composition is EVICT+SELECT, two parts")
        evict, select = (parse_spec(part, page_size=page_size, defaults=defaults) for part in parts)
        policy = make_policy("compose", evict=evict, select=select)
    else:
        name, _, text = spec.strip().partition(":")
        pairs = [o for o in text.split(",") if o.strip()] + options
        policy = _with_defaults(name, parse_policy_options(name, pairs), defaults)
    policy.validate(page_size)
    return policy


def _with_defaults(name: str, options: dict[str, Any], defaults: dict[str, Any]):
    """`make_policy(name, **options)`, with the `defaults` the policy has a field for and `options` lack."""
    from kvjax.policies.base import make_policy

    cls = POLICY_REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; registered: {', '.join(sorted(POLICY_REGISTRY))}")
    if name != "full" and defaults:
        known = cls.option_types({**defaults, **options})
        options = {**{k: v for k, v in defaults.items() if k in known}, **options}
    return make_policy(name, **options)
