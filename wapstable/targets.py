"""What a config's `_target_` names: the class, imported from the Python path, or one sentence saying why not."""

import importlib
import pkgutil

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

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


def typed_options(schema: type, given: dict, key: str, see: str):
    """`given` merged onto the dataclass `schema` and built: an instance whose values OmegaConf typed (a wrong type or
    an unknown key is a UserError naming `key.FIELD` and pointing to `see`), and whose own check (a UserError raised
    in its constructor) comes through as it was raised."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), given))
    except OmegaConfBaseException as e:
        if isinstance(e.__cause__, UserError):  # the dataclass's own check, raised inside its constructor
            raise e.__cause__ from None
        where = f"{key}.{e.full_key}" if getattr(e, "full_key", None) else key
        raise UserError(f"{where}: {str(e).splitlines()[0]}; see {see}") from None
