"""Each sampler parameter is declared once (`metaloom.sampling.knobs`): its field carries the
pipeline step that reads it, its validation, its CLI flag and its remote probe value. These
tests hold every consumer to the declarations, so a new parameter that is declared is wired
everywhere, and one that is not fails here."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from metaloom.commands.common import add_sampling_args, sampling_params
from metaloom.errors import InvalidParameter
from metaloom.generator.remote.detect import EXTRA_SAMPLING, PROBE_VALUES
from metaloom.generator.remote.wire import OPENAI_SAMPLING
from metaloom.sampling import SamplingParams, make_sampler
from metaloom.sampling.knobs import knobs
from metaloom.sampling.params import ADAPTER_COLUMNS, PROBES, SAMPLER_FLAGS
from metaloom.sampling.truncation import STEPS

KNOBS = {f.name: k for f, k in knobs(SamplingParams)}
# the request's own fields, not samplers: how much, how many, which seed, where to stop, what to report
REQUEST = {"logit_bias", "max_tokens", "n", "seed", "stop", "ignore_eos", "include_stop_str_in_output", "top_logprobs"}


def test_every_field_is_a_declared_sampler_or_the_requests_own() -> None:
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert names == set(KNOBS) | REQUEST and not set(KNOBS) & REQUEST


def test_every_sampler_beyond_openais_has_a_probe_value_a_server_can_be_asked_about() -> None:
    for name in KNOBS:
        if name not in OPENAI_SAMPLING:
            assert name in PROBES, f"{name}: declare probe= with its knob"
    assert PROBE_VALUES == PROBES and set(PROBES) == EXTRA_SAMPLING  # each probed one by one
    for name, value in PROBES.items():  # each probe is valid and away from the default
        value = tuple(value) if isinstance(value, list) else value
        params = SamplingParams(temperature=0.5, **{name: value})
        assert getattr(params, name) != getattr(SamplingParams(), name), name


@pytest.mark.parametrize("name", sorted(KNOBS))
def test_each_knob_validates_and_names_itself(name: str) -> None:
    bad = {int: 1.5, float: float("nan"), tuple: "not a tuple", str: 3}
    default = getattr(SamplingParams(), name)
    with pytest.raises(InvalidParameter) as err:
        SamplingParams(**{name: bad[type(default)]})
    assert err.value.name == name


def test_the_cli_has_a_flag_for_each_declared_parameter() -> None:
    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    flagged = {name for name, _, _ in SAMPLER_FLAGS}
    assert flagged == {n for n, k in KNOBS.items() if k.help is not None}
    assert KNOBS["dry_sequence_breakers"].help is None  # its own repeatable flag
    for name in flagged:
        value = PROBES.get(name, 0.5)
        args = parser.parse_args(["--temperature", "0.5", f"--{name.replace('_', '-')}", str(value)])
        assert getattr(sampling_params(args), name) == value, name


def test_the_pipeline_reads_the_declared_columns_and_steps() -> None:
    switches = {n for n, k in KNOBS.items() if k.switch and k.adapter}
    for name in switches:  # each switch turns its adapter on, and the sampler stacks its columns
        params = SamplingParams(temperature=0.5, **{name: PROBES.get(name, 0.5)})
        adapter = KNOBS[name].adapter
        assert adapter in params.adapters, name
        sampler = make_sampler([params], 16, encode=lambda text: [ord(text[0]) % 16])
        assert set(ADAPTER_COLUMNS.get(adapter, ())) <= set(sampler.columns), name
    assert all(step.field in KNOBS for step in STEPS)
    assert not SamplingParams(temperature=0, top_k=3).adapters  # greedy rows skip the truncation
    assert SamplingParams(temperature=0, repetition_penalty=1.2).adapters == {"repetition"}  # not penalties
