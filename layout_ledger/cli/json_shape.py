"""How a report dataclass becomes its ``--json`` object: one rule, exceptions named on fields.

Every field appears under its own name, tuples as lists and nested dataclasses as objects. A
field says otherwise with ``json_field``: another key, left out, converted, or spread into the
object (its converted value's keys become the object's). Read-only properties that belong in the
object are named in the class's ``json_properties``. ``JsonShaped`` gives a dataclass the
``to_json()`` that applies this.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

JsonObject = dict[str, Any]

_METADATA_KEY = "layout_ledger.json"


@dataclasses.dataclass(frozen=True)
class JsonRule:
    """How one field appears in its object."""

    key: str | None = None
    omit: bool = False
    convert: Callable[[Any], Any] | None = None
    spread: bool = False


_PLAIN = JsonRule()


def json_field(
    *,
    key: str | None = None,
    omit: bool = False,
    convert: Callable[[Any], Any] | None = None,
    spread: bool = False,
) -> Mapping[str, JsonRule]:
    """A field's ``metadata=``: ``key`` renames it, ``omit`` leaves it out, ``convert`` maps its
    value first, ``spread`` merges the (converted) object's keys into the parent."""
    return {_METADATA_KEY: JsonRule(key, omit, convert, spread)}


def json_value(value: Any) -> Any:
    """A value as JSON sees it: dataclasses as objects, tuples as lists, the rest as is."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return json_object(value)
    if isinstance(value, list | tuple):
        return [json_value(item) for item in value]
    if isinstance(value, dict):
        return {key: json_value(item) for key, item in value.items()}
    return value


def json_object(instance: Any) -> JsonObject:
    """The ``--json`` object of a dataclass instance, by the rules above."""
    shaped: JsonObject = {}
    for field in dataclasses.fields(instance):
        rule: JsonRule = field.metadata.get(_METADATA_KEY, _PLAIN)
        if rule.omit:
            continue
        raw = getattr(instance, field.name)
        value = json_value(raw if rule.convert is None else rule.convert(raw))
        if rule.spread:
            shaped.update(value)
        else:
            shaped[rule.key or field.name] = value
    for name in getattr(type(instance), "json_properties", ()):
        shaped[name] = json_value(getattr(instance, name))
    return shaped


class JsonShaped:
    """A dataclass whose ``to_json()`` is derived from its fields (``json_object``)."""

    json_properties: ClassVar[tuple[str, ...]] = ()

    def to_json(self) -> JsonObject:
        return json_object(self)
