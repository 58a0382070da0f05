"""``ModelShape``: what a model keeps per token and per layer, before parallelism.

A model's layers fall into object groups (``docs/planning.md``)::

    full attention     K and V of every token       2 x kv_heads x head_dim x dtype per token
    sliding window W   K and V of the last W tokens  (same per token, at most W tokens)
    MLA latent         one latent per token          (latent_dim + rope_dim) x dtype per token
    recurrent state    a fixed-size state            state_bytes per layer, whatever the length

Every number is logical: the whole model once, before TP splits or replicates
it (``kvtier.planner.plan`` does that). Messages name the ``kvtier plan`` flag
to change, since that is where these numbers usually come from.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.layout import DTYPE_BYTES

# ``--dtype`` choices -> ``KVLayout.dtype`` names
DTYPES: dict[str, str] = {
    "fp32": "float32",
    "bf16": "bfloat16",
    "fp16": "float16",
    "fp8": "float8_e4m3fn",
}


def require_positive(flag: str, value: float | None, *, allow_zero: bool = False) -> None:
    """ValueError naming ``flag`` unless ``value`` is a positive (or zero) number."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{flag} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero) or value != value:
        least = "zero or more" if allow_zero else "positive"
        raise ValueError(f"{flag} must be {least}, got {value!r}")


def require_fraction(flag: str, value: float, *, allow_zero: bool = False) -> None:
    """ValueError naming ``flag`` unless ``value`` is in (0, 1] (or [0, 1])."""
    low_ok = value >= 0 if allow_zero else value > 0
    if not (low_ok and value <= 1):
        interval = "[0, 1]" if allow_zero else "(0, 1]"
        raise ValueError(f"{flag} must be in {interval}, got {value!r}")


def require_int(flag: str, value: int | None, *, allow_zero: bool = False) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{flag} must be a whole number, got {value!r}")
    require_positive(flag, value, allow_zero=allow_zero)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A model's KV shape; see the module docstring.

    ``layers`` counts every layer. ``sliding_layers`` of them keep at most
    ``sliding_window`` tokens and ``state_layers`` of them hold a recurrent
    state of ``state_bytes``; the rest are full attention (or MLA when
    ``mla_latent_dim`` is set). ``attention_heads``, ``qk_head_dim`` and
    ``v_head_dim`` only size the attention FLOPs of a recompute.
    """

    layers: int
    dtype: str = "bf16"
    kv_heads: int | None = None
    head_dim: int | None = None
    mla_latent_dim: int | None = None
    mla_rope_dim: int = 0
    sliding_window: int | None = None
    sliding_layers: int = 0
    state_layers: int = 0
    state_bytes: int = 0
    attention_heads: int | None = None
    qk_head_dim: int | None = None
    v_head_dim: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        require_int("--layers", self.layers)
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        for flag, value in (
            ("--kv-heads", self.kv_heads),
            ("--head-dim", self.head_dim),
            ("--mla-latent-dim", self.mla_latent_dim),
            ("--sliding-window", self.sliding_window),
            ("--attention-heads", self.attention_heads),
            ("--qk-head-dim", self.qk_head_dim),
            ("--v-head-dim", self.v_head_dim),
        ):
            require_int(flag, value)
        for flag, count in (
            ("--mla-rope-dim", self.mla_rope_dim),
            ("--sliding-layers", self.sliding_layers),
            ("--state-layers", self.state_layers),
            ("--state-bytes", self.state_bytes),
        ):
            require_int(flag, count, allow_zero=True)
        self._check_attention()
        self._check_layer_split()

    def _check_attention(self) -> None:
        if self.mla:
            if self.kv_heads is not None:
                raise ValueError(
                    "--kv-heads does not apply to an MLA model (one latent per token per "
                    "layer); drop it or drop --mla-latent-dim"
                )
            if self.sliding_layers:
                raise ValueError("--sliding-layers with --mla-latent-dim is not supported")
            return
        if self.mla_rope_dim:
            raise ValueError("--mla-rope-dim needs --mla-latent-dim (the MLA latent size)")
        if self.kv_heads is None:
            raise ValueError(
                "--kv-heads is missing: pass the number of KV heads (num_key_value_heads "
                "in config.json), or --mla-latent-dim for an MLA model"
            )
        if self.head_dim is None:
            raise ValueError("--head-dim is missing: pass the size of one attention head")

    def _check_layer_split(self) -> None:
        if self.sliding_layers and self.sliding_window is None:
            raise ValueError("--sliding-layers needs --sliding-window (the window in tokens)")
        if self.sliding_window is not None and not self.sliding_layers:
            raise ValueError("--sliding-window needs --sliding-layers (how many layers use it)")
        if self.state_layers and not self.state_bytes:
            raise ValueError("--state-layers needs --state-bytes (one layer's state size)")
        if self.state_bytes and not self.state_layers:
            raise ValueError("--state-bytes needs --state-layers (how many layers hold it)")
        if self.sliding_layers + self.state_layers > self.layers:
            raise ValueError(
                f"--sliding-layers ({self.sliding_layers}) plus --state-layers "
                f"({self.state_layers}) exceed --layers ({self.layers})"
            )

    @property
    def mla(self) -> bool:
        return self.mla_latent_dim is not None

    @property
    def layout_dtype(self) -> str:
        """The ``KVLayout.dtype`` of this shape's KV."""
        return DTYPES[self.dtype]

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.layout_dtype]

    @property
    def full_layers(self) -> int:
        """Layers that keep every token (full attention or MLA)."""
        return self.layers - self.sliding_layers - self.state_layers

    @property
    def attention_layers(self) -> int:
        return self.layers - self.state_layers


__all__ = ["DTYPES", "ModelShape", "require_fraction", "require_int", "require_positive"]
