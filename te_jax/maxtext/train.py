"""``python -m te_jax.maxtext.train <MaxText train arguments>``: MaxText's trainer with te_jax's names registered.

The same command line as ``python -m maxtext.trainers.pre_train.train``
(a config file, then ``key=value`` overrides); ``quantization=`` also takes
``te_jax_delayed``, ``te_jax_current``, ``te_jax_block``, ``te_jax_mxfp8`` and
``te_jax_nvfp4``.
"""

from __future__ import annotations

from collections.abc import Sequence

from te_jax.maxtext.register import register


def main(argv: Sequence[str]) -> None:
    """Register te_jax's recipes, then run MaxText's ``train.main(argv)`` (argv[0]: the program, ignored)."""
    register()
    from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel

    train.main(argv)


if __name__ == "__main__":
    from absl import app

    app.run(main)
