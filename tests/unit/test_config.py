"""The configuration is the one place of every knob: its fields drive validation, the keywords of
custom_generate, the command line and the README's table."""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path

import pytest

from probe_mtp import ProbeConfig, custom_generate
from probe_mtp.config import config_table
from probe_mtp.decoder import ProbeDecoder
from probe_mtp.drafters import DRAFTERS
from probe_mtp.options import add_config_arguments, config_from_args

README = Path(__file__).resolve().parents[2] / "README.md"


def test_every_knob_is_documented_and_in_the_docstring():
    for f in ProbeConfig.knobs():
        assert f.metadata["doc"].strip(), f.name
        assert f"``{f.name}``" in ProbeConfig.__doc__


def test_readme_table_is_generated_from_the_config():
    block = re.search(r"<!-- config-table -->\n(.*?)<!-- /config-table -->", README.read_text(encoding="utf-8"), re.S)
    assert block, "README.md lost its config-table block"
    assert block.group(1).strip() == config_table().strip(), "run: python scripts/readme_config_table.py"


def test_custom_generate_and_the_decoder_take_every_knob():
    """transformers hands a custom_generate function only the keywords its signature names."""
    names = set(ProbeConfig.field_names())
    assert names <= set(inspect.signature(custom_generate).parameters)
    assert names <= set(inspect.signature(ProbeDecoder.handle_prepared).parameters)


def test_command_line_options_come_from_the_fields():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    options = {a.dest for a in parser._actions}
    assert {f.name for f in ProbeConfig.knobs() if f.metadata["cli"]} <= options
    args = parser.parse_args(["--num-masks", "2", "--budget", "auto", "--prune-repeats", "false", "--drafter", "esp"])
    assert config_from_args(args) == {"num_masks": 2, "budget": "auto", "prune_repeats": False, "drafter": "esp"}
    ProbeConfig(**config_from_args(args))
    with pytest.raises(SystemExit):
        parser.parse_args(["--drafter", "nope"])


def test_sweep_options_take_comma_lists():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, sweep=True, defaults={"budget": "30"})
    args = parser.parse_args(["--budget", "10,auto,10", "--drafter", "esp,pld"])
    assert args.budget == (10, "auto") and args.drafter == ("esp", "pld")
    assert parser.parse_args([]).budget == (30,)
    # repeated, an option adds to its list (the first occurrence replaces the default)
    args = parser.parse_args(["--budget", "10", "--budget", "60,10", "--masks", "prompt_mean", "--masks", "a/b.safetensors"])
    assert args.budget == (10, 60) and args.masks == ("prompt_mean", "a/b.safetensors")


def test_drafter_choices_come_from_the_registry():
    drafter = next(f for f in ProbeConfig.knobs() if f.name == "drafter")
    assert drafter.metadata["choices"] == tuple(DRAFTERS)
    with pytest.raises(ValueError, match="unknown drafter 'nope'; choose one of: hybrid, esp"):
        ProbeConfig(drafter="nope")


@pytest.mark.parametrize("knobs,match", [
    (dict(num_masks=0), "num_masks must be an integer >= 1 for drafter='esp'"),
    (dict(budget=3), "budget=3 is too small for num_masks=1"),
    (dict(budget="wide"), "budget must be an integer"),
    (dict(mask_init="zeros"), "mask_init must be one of"),
    (dict(mask_init="token"), "needs mask_token"),
    (dict(mask_update=2.0), r"lie in \[0, 1\]"),
    (dict(sampling_rule="best"), "sampling_rule must be one of"),
    (dict(acceptance="maybe"), "acceptance must be one of"),
    (dict(threshold=-1), "threshold must be a number"),
    (dict(pass_memory=-0.1), "pass_memory must be a share"),
])
def test_bad_knobs_are_clear_errors(knobs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ProbeConfig(drafter="esp", **knobs)


def test_mask_use_is_read_from_the_drafter_class():
    assert ProbeConfig(drafter="hybrid", num_masks=0).num_masks == 0
    assert ProbeConfig(drafter="pld", budget=2).tree_budget == 2
    with pytest.raises(ValueError, match="confadapt"):
        ProbeConfig(drafter="pld", acceptance="confadapt")
