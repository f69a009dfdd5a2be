"""The recipe gallery loader: ``load_recipe`` and ``recipe_names``.

A recipe comes from a file path, a built-in name, a gallery name or an
importable module. The gallery is looked up in two explicit places: the
``recipes/`` folder of the source tree te_jax runs from, and the copy a wheel
carries (``te_jax/gallery``); never the current directory (pass a path for a
file there).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

from te_jax.recipe.recipes import BUILTIN, CustomRecipe, Recipe

__all__ = ["load_recipe", "recipe_names"]


def _snake_case(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()


def _builtin_by_name() -> dict[str, type[Recipe]]:
    """Every spelling of every built-in recipe (short, class name, snake case), lower-cased."""
    names = dict(BUILTIN)
    for cls in BUILTIN.values():
        names[cls.__name__.lower()] = names[_snake_case(cls.__name__)] = cls
    return names


def _gallery_dirs() -> list[Path]:
    package = Path(__file__).resolve().parent.parent  # te_jax/
    return [package.parent / "recipes", package / "gallery"]  # a source tree's recipes/; a wheel's te_jax/gallery/


def recipe_names() -> list[str]:
    """The names ``load_recipe`` takes, besides file paths and module names.

    The built-ins' short names, then their class names and snake cases, then
    the gallery's recipes (``recipes/*.py`` wherever ``load_recipe`` looks).
    """
    builtins = list(BUILTIN)
    for cls in BUILTIN.values():
        builtins += [cls.__name__, _snake_case(cls.__name__)]
    gallery = sorted({p.stem for d in _gallery_dirs() if d.is_dir() for p in d.glob("*.py")
                      if not p.stem.startswith("_")})
    return builtins + gallery


def load_recipe(path_or_name: str, *, num_layers: int | None = None) -> Recipe:
    """A recipe from a file, a built-in or gallery name, or a module.

    Accepted, in this order:

    * a path to a ``.py`` file that defines ``qfactory(role)``
      (``"recipes/current_scaling_ref.py"``): wrapped in CustomRecipe;
    * a built-in recipe with default fields, by short name (``BUILTIN``:
      ``"delayed"``, ``"current"``, ``"block"``, ``"mxfp8"``, ``"nvfp4"``),
      class name (``"DelayedScaling"``) or its snake case
      (``"delayed_scaling"``), in any letter case;
    * a gallery name (``"current_scaling_ref"``): ``recipes/NAME.py`` in the
      source tree te_jax runs from, or in the copy of that gallery a wheel
      carries (``te_jax/gallery``);
    * an importable module name that defines ``qfactory``.

    ``recipe_names()`` lists the names.

    A recipe that places quantization by block position depends on the
    model's depth: its module defines ``make_qfactory(num_layers)`` (see
    ``recipes/nvfp4_first_last_bf16.py``), and ``num_layers`` is then
    required. There is no default depth: a recipe built for the wrong one
    would quantize the wrong blocks without a word.

    Args:
      path_or_name: one of the above.
      num_layers: the model's depth (number of transformer blocks), for
        recipes that treat blocks by position: a module that defines
        ``make_qfactory(num_layers)`` gets its factory from it. Other recipes
        ignore it.

    Raises:
      FileNotFoundError: a path (ending in ``.py`` or holding a ``/``) that is no file.
      ValueError: a name that is none of the above (the message lists the
        names), a module without ``qfactory`` (or ``make_qfactory``), a
        depth-dependent recipe without ``num_layers``, or a bad ``num_layers``.
    """
    if num_layers is not None and (isinstance(num_layers, bool) or not isinstance(num_layers, int)
                                   or num_layers < 1):
        raise ValueError(f"te_jax: load_recipe(num_layers=...) must be a positive int, got {num_layers!r}")
    text = str(path_or_name)
    if Path(text).is_file():
        return _from_file(Path(text), text, num_layers)
    if text.endswith(".py") or "/" in text:
        raise FileNotFoundError(f"te_jax: no recipe file {text!r}")
    builtin = _builtin_by_name().get(text.lower())
    if builtin is not None:
        return builtin()
    for path in (d / f"{text}.py" for d in _gallery_dirs()):
        if path.is_file():
            return _from_file(path, text, num_layers)
    try:
        module = importlib.import_module(text)
    except ImportError:
        raise ValueError(
            f"te_jax: no recipe named {text!r}. Names: {', '.join(recipe_names())}; or a path to a .py file, "
            "or an importable module, that defines qfactory(role)"
        ) from None
    return _wrap(module, text, num_layers)


def _from_file(path: Path, where: str, num_layers: int | None) -> CustomRecipe:
    """The recipe module at ``path``; ``where`` is the name it was asked for, as errors give it."""
    spec = importlib.util.spec_from_file_location(f"te_jax_recipe_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return _wrap(module, where, num_layers)


def _wrap(module, where: str, num_layers: int | None) -> CustomRecipe:
    make = getattr(module, "make_qfactory", None)
    if callable(make):  # the recipe depends on the model's depth: never a default one
        if num_layers is None:
            raise ValueError(
                f"te_jax: recipe {where!r} places quantization by transformer block and needs the model's depth: "
                f"load_recipe({where!r}, num_layers=<the model's number of blocks>)")
        return CustomRecipe(qfactory=make(num_layers))
    qfactory = getattr(module, "qfactory", None)
    if not callable(qfactory):
        raise ValueError(f"te_jax: recipe module {where!r} must define a function qfactory(role) (or, for a recipe "
                         "that depends on the model's depth, make_qfactory(num_layers))")
    return CustomRecipe(qfactory=qfactory)
