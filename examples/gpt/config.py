"""A training run's settings (``RunConfig``), their checks, and the recipe a ``--recipe`` name stands for.

Every value a flag can hold is checked before anything is compiled:
``RunConfig.check`` raises ValueError naming the flag, and the command line
(``train.main``) prints that message argparse-style and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from examples.gpt import parallel
from examples.gpt.model import REMAT_POLICIES
from examples.gpt.presets import PRESETS, ModelConfig
from te_jax import recipe as R

NO_RECIPE = {
    "bf16": "no quantization (autocast disabled)",
    "flax-fp8": "the same blocks through flax.linen's Fp8DotGeneral, no te_jax recipe (the baseline)",
    "flax": "the dense blocks built from flax.linen's own layers, bf16 (the peer with no te_jax kernel)",
}
"""The ``--recipe`` names that are no te_jax recipe; every other name goes to ``te_jax.recipe.load_recipe``."""


REMAT_CHOICES = tuple(REMAT_POLICIES)
"""``--remat``'s policies (examples.gpt.model.REMAT_POLICIES: te_jax.flax's, by what a block keeps)."""


def make_recipe(name: str, num_layers: int | None = None) -> R.Recipe | None:
    """The recipe ``--recipe name`` stands for: None for ``NO_RECIPE``, else ``te_jax.recipe.load_recipe``'s.

    ``num_layers`` (the model's depth) reaches gallery recipes that place
    quantization by block position (``recipes/nvfp4_first_last_bf16.py``).

    Raises:
      ValueError: a name that is no recipe (the message lists the names), a
        path that is no file, or a recipe module without ``qfactory``.
    """
    if name in NO_RECIPE:
        return None
    try:
        return R.load_recipe(name, num_layers=num_layers)
    except (ValueError, FileNotFoundError) as err:
        also = "" if name.endswith(".py") or "/" in name else f" (--recipe also takes {', '.join(NO_RECIPE)})"
        raise ValueError(f"--recipe {name}: {err}{also}") from None


def recipe_label(name: str) -> str:
    return Path(name).stem if name.endswith(".py") else name


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One run's settings; each field is the command-line flag of the same name. None: the preset's value."""

    preset: str = "tiny"
    recipe: str = "bf16"
    steps: int | None = None
    batch: int | None = None
    seq_len: int | None = None
    lr: float | None = None
    warmup: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    seed: int = 0
    eval_every: int | None = None
    eval_batches: int | None = None
    log_every: int = 10
    data: str | None = None
    data_bytes: int = 16 << 20
    mesh: str = ""
    ckpt_dir: str | None = None
    ckpt_every: int = 0
    resume: str | None = None  # "latest" or a step number
    tensorboard: str | None = None
    progress: bool = True
    dtype: str | None = None
    inspect: str | None = None  # directory for te_jax.inspect statistics (None: off)
    inspect_every: int = 1  # statistics read every k-th row of activations and gradients (te_jax.inspect.Sample)
    remat: str = "none"  # every block under nn.remat with this policy (examples.gpt.model.REMAT_POLICIES)
    recompute_norm_act: bool = False  # te_jax's layers recompute their norm and activation outputs in backward

    def resolved(self) -> RunConfig:
        """With the preset's values filled in where a field is None."""
        if self.preset not in PRESETS:
            raise ValueError(f"--preset: no preset {self.preset!r}; choose from {', '.join(PRESETS)}")
        p = PRESETS[self.preset]
        fill = dict(steps=p.steps, batch=p.batch, seq_len=p.seq_len, lr=p.lr, warmup=p.warmup,
                    eval_every=p.eval_every, eval_batches=p.eval_batches, dtype=p.model.dtype)
        return dataclasses.replace(self, **{k: v for k, v in fill.items() if getattr(self, k) is None})

    def model_config(self) -> ModelConfig:
        m = PRESETS[self.preset].model
        return dataclasses.replace(m, max_len=max(m.max_len, self.seq_len), dtype=self.dtype,
                                   flax_fp8=self.recipe == "flax-fp8", flax_linen=self.recipe == "flax",
                                   remat=self.remat, recompute_norm_act=self.recompute_norm_act)

    def check(self) -> dict[str, int]:
        """Raises ValueError, naming the flag, for a value no run can use; returns the mesh's shape.

        Call it on the resolved config. The recipe, the data and the
        checkpoint to resume from are checked where they are loaded.
        """
        at_least = {1: {"--steps": self.steps, "--batch": self.batch, "--seq-len": self.seq_len,
                        "--eval-batches": self.eval_batches, "--log-every": self.log_every,
                        "--data-bytes": self.data_bytes, "--inspect-every": self.inspect_every},
                    0: {"--warmup": self.warmup, "--eval-every": self.eval_every, "--ckpt-every": self.ckpt_every}}
        for least, values in at_least.items():
            for flag, value in values.items():
                if isinstance(value, bool) or not isinstance(value, int) or value < least:
                    raise ValueError(f"{flag} must be an integer >= {least}, got {value!r}")
        for flag, value, positive in (("--lr", self.lr, True), ("--clip", self.clip, True),
                                      ("--weight-decay", self.weight_decay, False)):
            if not math.isfinite(value) or value < 0 or (positive and value == 0):
                raise ValueError(f"{flag} must be a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio!r}")
        if self.resume is not None:
            if not self.ckpt_dir:
                raise ValueError("--resume needs --ckpt-dir")
            if self.resume != "latest" and not self.resume.isdigit():
                raise ValueError(f"--resume takes 'latest' or a step number, got {self.resume!r}")
        if self.remat not in REMAT_CHOICES:
            raise ValueError(f"--remat takes {', '.join(REMAT_CHOICES)}, got {self.remat!r}")
        shape = parallel.parse_mesh(self.mesh)
        m = PRESETS[self.preset].model
        if self.recipe == "flax" and m.experts:
            raise ValueError(f"--recipe flax: the {self.preset} preset's experts have no flax.linen layer; use bf16")
        if self.recipe in ("flax", "flax-fp8") and self.recompute_norm_act:
            raise ValueError(f"--recompute-norm-act is an option of te_jax's own products, which --recipe "
                             f"{self.recipe} does not use; drop it for that run (--remat applies to every recipe)")
        if shape["ep"] > 1 and not m.experts:
            moe = ", ".join(name for name, p in PRESETS.items() if p.model.experts)
            raise ValueError(f"--mesh ep={shape['ep']}: the {self.preset} preset has no experts to split; use an MoE "
                             f"preset ({moe}) or drop ep")
        if shape["ep"] > 1 and m.experts % shape["ep"]:
            raise ValueError(f"--mesh ep={shape['ep']} must divide the {self.preset} preset's experts ({m.experts})")
        if m.experts and shape["tp"] > 1:
            raise ValueError(f"--mesh tp={shape['tp']}: the {self.preset} preset's experts are not tensor parallel; "
                             "use dp, fsdp and ep")
        data_ways = shape["dp"] * shape["fsdp"] * shape["ep"]
        if self.batch % data_ways:
            raise ValueError(f"--batch {self.batch} must be divisible by dp*fsdp*ep = {data_ways}")
        for name, size in (("attention heads", m.heads), ("key/value heads", m.kv_heads),
                           ("MLP width", m.mlp_hidden)):
            if size % shape["tp"]:
                raise ValueError(f"--mesh tp={shape['tp']} must divide the {self.preset} preset's {name} ({size})")
        return shape
