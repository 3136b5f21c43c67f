"""What a config's `_target_` names: the class, imported from the Python path, or one sentence saying why not."""

import importlib

from wapstable.errors import UserError


def import_class(target: str, key: str, hint: str) -> type:
    """The class `target` ("package.module.Class") names; a UserError naming `key._target_` and `hint` otherwise."""
    module, _, name = str(target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError) as e:
        raise UserError(f"{key}._target_={target} is not an importable class ({e}); {hint}") from None
    if not isinstance(cls, type):
        raise UserError(f"{key}._target_={target} is not an importable class; {hint}")
    return cls
