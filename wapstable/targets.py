"""What a config's `_target_` names: the class, imported from the Python path, or one sentence saying why not."""

import importlib
import pkgutil

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


def classes_in(package: str, path, kind: type) -> list[type]:
    """The subclasses of `kind` defined in the modules of `package` (its `__path__`): the built-in parts a listing
    or a mapper of old configs finds without a table to keep up to date."""
    found = []
    for module in pkgutil.iter_modules(path):
        mod = importlib.import_module(f"{package}.{module.name}")
        found += [
            obj
            for obj in vars(mod).values()
            if isinstance(obj, type)
            and issubclass(obj, kind)
            and obj is not kind
            and obj.__module__ == mod.__name__
        ]
    return found
