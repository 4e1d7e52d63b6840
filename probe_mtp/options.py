"""Command line options shared by the subcommands, derived from :class:`~probe_mtp.config.ProbeConfig`.

Every knob of the configuration with ``cli`` set becomes ``--name-with-dashes``, with the field's
documentation as its help, its choices, and its type read from the field's default (or its
``cli_type``).  A knob left out on the command line keeps the configuration's default.  A command
that measures several settings side by side (the report) takes comma lists for the knobs marked
``sweep``.
"""

from __future__ import annotations

import argparse

import torch

from .config import ProbeConfig

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
TRUE, FALSE = ("true", "yes", "1", "on"), ("false", "no", "0", "off")


AUTO = "auto"


def parse_dtype(name: str) -> torch.dtype | str:
    if name == AUTO:
        return AUTO
    try:
        return DTYPES[name]
    except KeyError:
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}; choose from {sorted(DTYPES) + [AUTO]}") from None


DTYPE_HELP = (
    "auto: the fastest exact configuration on this machine (bf16 or float32 prepared by probe_mtp.optimize, stock "
    "float32, or float32 packed for wide passes by probe_mtp.pack_wide, by MKL or oneDNN), measured at a model's first "
    "load and kept "
    "in the cache; float32 (exact, stock kernels); bfloat16 or float16 "
    "(stock kernels: outputs may differ from model.generate at near-ties)"
)


def add_model_arguments(p: argparse.ArgumentParser, dtype: str = AUTO) -> None:
    p.add_argument("--model", default=None, help="smollm2-135m (default), gemma3-270m, a local folder, a .gguf file or a hub id")
    p.add_argument("--dtype", type=parse_dtype, default=parse_dtype(dtype), help=f"{DTYPE_HELP} (default {dtype})")


def _parse_bool(text: str) -> bool:
    if text.lower() in TRUE:
        return True
    if text.lower() in FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def knob_parser(field):
    """How a knob's command line text becomes a value: from the field's ``cli_type`` or default."""
    parse = field.metadata.get("cli_type")
    if parse is None:
        default = field.default
        kinds = [_parse_bool] if isinstance(default, bool) else [k for k in (int, float, str) if isinstance(default, k)]
        parse = kinds[0] if kinds else str

    def parse_text(text: str):
        try:
            return parse(text)
        except (ValueError, TypeError) as exc:
            kind = getattr(parse, "__name__", "value").replace("parse_", "").replace("_", " ")
            raise argparse.ArgumentTypeError(f"{option_name(field.name)} takes {kind}, got {text!r} ({exc})") from None

    return parse_text


def _sweep_parser(parse):
    def parse_list(text: str) -> tuple:
        items = [part.strip() for part in text.split(",") if part.strip()]
        if not items:
            raise argparse.ArgumentTypeError("expected one value or a comma list")
        return tuple(dict.fromkeys(parse(item) for item in items))

    return parse_list


class _SweepAction(argparse.Action):
    """A comma-list option that may also be repeated: ``--masks a --masks b`` means ``--masks a,b``
    (the first occurrence replaces the command's default, later ones add to it)."""

    def __call__(self, parser, namespace, values, option_string=None):
        given = getattr(namespace, "_sweeps_given", set())
        before = tuple(getattr(namespace, self.dest) or ()) if self.dest in given else ()
        setattr(namespace, self.dest, tuple(dict.fromkeys(before + tuple(values))))
        namespace._sweeps_given = given | {self.dest}


def option_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_arguments(p: argparse.ArgumentParser, sweep: bool = False, defaults: dict | None = None,
                         aliases: dict | None = None, notes: dict | None = None) -> None:
    """One option per command line knob of :class:`ProbeConfig`; with ``sweep``, the knobs marked
    ``sweep`` take a comma list (every value is measured).  ``defaults``: values (command line text)
    that replace the configuration's default for this command; ``aliases``: more option strings
    per knob; ``notes``: what a knob left out means, where that is not the default's value."""
    defaults, aliases, notes = defaults or {}, aliases or {}, notes or {}
    group = p.add_argument_group("decoder settings (probe_mtp.ProbeConfig)")
    for field in ProbeConfig.knobs():
        if not field.metadata["cli"]:
            continue
        parse = knob_parser(field)
        many = sweep and field.metadata["sweep"]
        choices = field.metadata["choices"]
        default_text = defaults.get(field.name)
        shown = notes.get(field.name, default_text if default_text is not None else field.default)
        doc = field.metadata["doc"].replace("%", "%%")
        help_text = f"{doc} (default {shown})" + (" [comma list: each value is measured]" if many else "")
        kwargs = dict(type=_sweep_parser(parse) if many else parse, help=help_text, dest=field.name,
                      default=None if default_text is None else (_sweep_parser(parse) if many else parse)(default_text))
        if choices and not many:
            kwargs["choices"] = choices
        if many:
            kwargs["action"] = _SweepAction
        group.add_argument(option_name(field.name), *aliases.get(field.name, ()), **kwargs)


def config_from_args(args) -> dict:
    """The knobs given on the command line (single values), as ``ProbeConfig`` keyword arguments."""
    given = {}
    for field in ProbeConfig.knobs():
        value = getattr(args, field.name, None)
        if value is not None:
            given[field.name] = value
    return given
